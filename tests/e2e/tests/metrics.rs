//! Operating flotilla: every process's `/metrics`, `/healthz` and `/readyz` on its
//! `--metrics-addr`, read as Prometheus and a kubelet would, before and after the thing each
//! metric counts changes. Real processes, real apiservers (the hub's store, the spoke).

use std::time::Duration;

use anyhow::Context as _;
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{
    Fleet, GatewayProc, free_port, http_get, hub_apiserver, on_both_carriers, scrape, start_agent,
    wait_for,
};
use flotilla_ops::exposition::{Exposition, FamilyType};
use flotilla_testenv::workspace_root;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const SEED_WORK: &str = "proto/tests/fixtures/manifestwork_my_first_work.yaml";
const WAIT: Duration = Duration::from_secs(60);

/// Every metric the hub serves (its own and its in-process gateway's), with its type.
const HUB_FAMILIES: [(&str, FamilyType); 13] = [
    ("flotilla_gateway_sessions", FamilyType::Gauge),
    ("flotilla_gateway_session_reconnects", FamilyType::Counter),
    ("flotilla_gateway_admissions_refused", FamilyType::Counter),
    ("flotilla_gateway_store_requests", FamilyType::Counter),
    ("flotilla_gateway_store_request_errors", FamilyType::Counter),
    (
        "flotilla_gateway_status_write_queue_depth",
        FamilyType::Gauge,
    ),
    ("flotilla_gateway_shards_owned", FamilyType::Gauge),
    ("flotilla_gateway_new_connections", FamilyType::Counter),
    ("flotilla_gateway_tls_resumptions", FamilyType::Counter),
    ("flotilla_hub_managedclusters", FamilyType::Gauge),
    ("flotilla_hub_manifestworks", FamilyType::Gauge),
    (
        "flotilla_hub_placements_without_decisions",
        FamilyType::Gauge,
    ),
    ("flotilla_hub_rollouts", FamilyType::Gauge),
];

/// The budget of a process's Kubernetes clients (hub, gateway, agent), with its type.
const KUBE_API_FAMILIES: [(&str, FamilyType); 2] = [
    ("flotilla_kube_api_requests_waited", FamilyType::Counter),
    ("flotilla_kube_api_wait_seconds", FamilyType::Counter),
];

/// Every metric the agent serves, with its type.
const AGENT_FAMILIES: [(&str, FamilyType); 5] = [
    (
        "flotilla_agent_work_apply_duration_seconds",
        FamilyType::Histogram,
    ),
    ("flotilla_agent_drift_repairs", FamilyType::Counter),
    ("flotilla_agent_status_outbox_depth", FamilyType::Gauge),
    ("flotilla_agent_hub_connected", FamilyType::Gauge),
    ("flotilla_agent_hub_connected_transport", FamilyType::Gauge),
];

fn has_families(page: &Exposition, families: &[(&str, FamilyType)]) {
    for (name, kind) in families {
        let family = page
            .family(name)
            .unwrap_or_else(|| panic!("{name} missing from /metrics"));
        assert_eq!(family.kind, *kind, "{name}");
        assert!(!family.help.is_empty(), "{name} has no HELP text");
        assert!(!family.samples.is_empty(), "{name} has no samples");
    }
}

/// Sample `name` with `labels` on the page at `address`, 0 when absent.
async fn value(address: &str, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
    Ok(scrape(address).await?.value(name, labels).unwrap_or(0.0))
}

/// Waits until sample `name` with `labels` at `address` satisfies `ok`.
async fn wait_value(
    address: &str,
    name: &str,
    labels: &[(&str, &str)],
    ok: impl Fn(f64) -> bool,
) -> anyhow::Result<f64> {
    wait_for(&format!("{name}{labels:?} at {address}"), WAIT, || async {
        let v = value(address, name, labels).await?;
        Ok(ok(v).then_some(v))
    })
    .await
}

on_both_carriers! {
    /// A cluster connects, gets a work, drifts and is repaired, dies and comes back: the hub's
    /// fleet gauges, its gateway's session metrics and the agent's own follow each step.
    async fn metrics_follow_a_cluster_through_a_work_drift_and_a_kill() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let fleet = Fleet::start_with(d, true, &["--metrics-addr=127.0.0.1:0"]).await?;
        let hub = fleet.hub.metrics_addr.clone().context("the hub wrote no metrics address")?;
        let carrier = fleet.hub.carrier.to_string();
        let other = if carrier == "grpc" { "quic" } else { "grpc" };
        let sessions = [("transport", carrier.as_str())];

        wait_for("the hub ready", WAIT, || async {
            Ok((http_get(&hub, "/readyz").await?.0 == 200).then_some(()))
        })
        .await?;
        let before = scrape(&hub).await?;
        has_families(&before, &HUB_FAMILIES);
        has_families(&before, &KUBE_API_FAMILIES);
        assert_eq!(before.value("flotilla_gateway_sessions", &sessions), Some(0.0));
        // A single-node hub's gateway acts for every shard.
        assert_eq!(before.value("flotilla_gateway_shards_owned", &[]), Some(64.0));
        let applied = [("condition", "Applied"), ("status", "True")];
        assert_eq!(before.value("flotilla_hub_manifestworks", &applied), Some(0.0));

        // The cluster connects: a session on the test's carrier, Available on the hub.
        let spoke = Spoke::start(d, &fleet.hub, "cluster1").await?;
        let agent_addr = format!("127.0.0.1:{}", free_port()?);
        let agent_flags = [
            "--resync-interval=1s",
            &format!("--metrics-addr={agent_addr}"),
            "--log-format=json",
        ];
        let mut agent = spoke.start_agent(d, &fleet.hub, &agent_flags)?;
        wait_value(&hub, "flotilla_gateway_sessions", &sessions, |v| v == 1.0).await?;
        wait_value(&hub, "flotilla_hub_managedclusters", &[("available", "True")], |v| v == 1.0).await?;
        // Its connection was counted before its handshake, within the rate, on its carrier.
        let admitted = [("outcome", "admitted"), ("transport", carrier.as_str())];
        assert!(value(&hub, "flotilla_gateway_new_connections_total", &admitted).await? >= 1.0);
        let over = [("outcome", "over_rate"), ("transport", carrier.as_str())];
        assert_eq!(value(&hub, "flotilla_gateway_new_connections_total", &over).await?, 0.0);
        wait_value(&agent_addr, "flotilla_agent_hub_connected", &[], |v| v == 1.0).await?;
        let page = scrape(&agent_addr).await?;
        has_families(&page, &AGENT_FAMILIES);
        has_families(&page, &KUBE_API_FAMILIES);
        assert_eq!(page.value("flotilla_agent_hub_connected_transport", &sessions), Some(1.0));
        assert_eq!(page.value("flotilla_agent_hub_connected_transport", &[("transport", other)]), Some(0.0));
        let (ready, body) = http_get(&agent_addr, "/readyz").await?;
        assert_eq!((ready, body.as_str()), (200, "ok\n"));

        // A work: applied on the real spoke, the agent's apply histogram moves, the hub counts
        // it Applied, and its status reached the store through the gateway.
        let status_writes = [("verb", "update_status")];
        let writes_before = value(&hub, "flotilla_gateway_store_requests_total", &status_writes).await?;
        let applies_before = value(&agent_addr, "flotilla_agent_work_apply_duration_seconds_count", &[]).await?;
        fleet.apply(&workspace_root().join(SEED_WORK))?;
        fleet.wait_applied("cluster1", "my-first-work").await?;
        wait_value(&hub, "flotilla_hub_manifestworks", &applied, |v| v == 1.0).await?;
        let writes = value(&hub, "flotilla_gateway_store_requests_total", &status_writes).await?;
        assert!(writes > writes_before, "status writes {writes_before} -> {writes}");
        // Two resyncs after the first apply, with nothing changed on the spoke: no drift.
        let applies = wait_value(
            &agent_addr,
            "flotilla_agent_work_apply_duration_seconds_count",
            &[],
            |v| v >= applies_before + 3.0,
        )
        .await?;
        let page = scrape(&agent_addr).await?;
        assert!(page.value("flotilla_agent_work_apply_duration_seconds_sum", &[]).unwrap_or(0.0) > 0.0);
        assert_eq!(page.value("flotilla_agent_drift_repairs_total", &[]), Some(0.0), "after {applies} applies");

        // Someone changes the Deployment on the spoke; the next resync writes it back.
        let out = spoke
            .env
            .kubectl()
            .args(["set", "image", "deployment/nginx-deployment", "nginx=nginx:drifted"])
            .output()?;
        anyhow::ensure!(out.status.success(), "kubectl set image: {}", String::from_utf8_lossy(&out.stderr));
        spoke.wait_deployment_image("nginx-deployment", Some("nginx:1.14.2")).await?;
        wait_value(&agent_addr, "flotilla_agent_drift_repairs_total", &[], |v| v >= 1.0).await?;
        wait_value(&agent_addr, "flotilla_agent_status_outbox_depth", &[], |v| v == 0.0).await?;

        // --log-format json: every line the agent wrote is a JSON object.
        let log = agent.log();
        assert!(log.lines().count() > 3, "{log}");
        for line in log.lines().filter(|l| !l.trim().is_empty()) {
            let event: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("agent log line is not JSON: {line}"))?;
            assert!(event["level"].is_string() && event["fields"].is_object(), "{line}");
        }

        // The agent is killed: its session goes, and after the grace period the hub counts the
        // cluster Unknown.
        agent.signal_and_wait(Signal::SIGKILL);
        wait_value(&hub, "flotilla_gateway_sessions", &sessions, |v| v == 0.0).await?;
        wait_value(&hub, "flotilla_hub_managedclusters", &[("available", "Unknown")], |v| v == 1.0).await?;
        assert_eq!(value(&hub, "flotilla_hub_managedclusters", &[("available", "True")]).await?, 0.0);

        // A denied cluster's agent is refused, and counted by reason.
        let denied = [("reason", "cluster_denied")];
        let refused = value(&hub, "flotilla_gateway_admissions_refused_total", &denied).await?;
        fleet.hub.dev_cert("store-denied", &d.join("denied"))?;
        fleet.cli(&["cluster", "deny", "store-denied", "--reason", "stolen device"])?;
        let denied_agent = start_agent(d, &fleet.hub, "store-denied", &d.join("denied"))?;
        wait_value(&hub, "flotilla_gateway_admissions_refused_total", &denied, |v| v > refused).await?;
        drop(denied_agent);

        // It comes back: a reconnect, and Available again.
        let reconnects = value(&hub, "flotilla_gateway_session_reconnects_total", &[]).await?;
        let _agent = spoke.start_agent(d, &fleet.hub, &agent_flags)?;
        wait_value(&hub, "flotilla_gateway_session_reconnects_total", &[], |v| v == reconnects + 1.0).await?;
        wait_value(&hub, "flotilla_gateway_sessions", &sessions, |v| v == 1.0).await?;
        wait_value(&hub, "flotilla_hub_managedclusters", &[("available", "True")], |v| v == 1.0).await?;
        Ok(())
    }
}

/// `/readyz` answers 503, saying what is missing, until the hub's caches have listed from the
/// store; then 200. `/healthz` answers all along: the process is alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_waits_for_the_first_list_from_the_store() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (env, kubeconfig) = hub_apiserver().await?;
    // The store answers nothing until SIGCONT: the hub starts, but cannot list.
    let apiserver = Pid::from_raw(env.apiserver_pid() as i32);
    kill(apiserver, Signal::SIGSTOP)?;
    let started = flotilla_e2e::Hub::start(
        dir.path(),
        &[
            "--store=kube",
            "--kubeconfig",
            &kubeconfig,
            "--metrics-addr=127.0.0.1:0",
            "--log-format=json",
        ],
    )
    .await;
    let checked = async {
        let hub = started?;
        let address = hub.metrics_addr.clone().context("no metrics address")?;
        assert_eq!(
            http_get(&address, "/healthz").await?,
            (200, "ok\n".to_string())
        );
        let (status, body) = http_get(&address, "/readyz").await?;
        assert_eq!(status, 503, "{body}");
        assert!(
            body.contains("ManagedCluster watch cache")
                && body.contains("ManifestWork watch cache"),
            "/readyz does not say what is missing: {body}"
        );
        kill(apiserver, Signal::SIGCONT)?;
        wait_for("/readyz 200 once the store answers", WAIT, || async {
            let (status, body) = http_get(&address, "/readyz").await?;
            Ok((status == 200 && body == "ok\n").then_some(()))
        })
        .await?;
        // --log-format json on the hub too.
        let log = hub.proc.log();
        let first = log.lines().next().context("the hub logged nothing")?;
        serde_json::from_str::<serde_json::Value>(first)
            .with_context(|| format!("hub log line is not JSON: {first}"))?;
        anyhow::Ok(())
    }
    .await;
    // Never leave the apiserver stopped, whatever failed.
    let _ = kill(apiserver, Signal::SIGCONT);
    checked
}

/// A `flotilla-gateway` replica serves the same page: it owns every shard once its leases are
/// claimed (the only gateway), while the hub's in-process gateway (`--gateways external`)
/// owns none. Its `/readyz` follows its watch caches and its shards: started while the store
/// answers nothing, it is alive, not ready, and closes agents' connections before TLS (a
/// herd arriving at a cold gateway costs it no handshake), counted as `not_ready`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_replica_serves_its_metrics_and_probes() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let (env, kc) = hub_apiserver().await?;
    let kubeconfig = env.kubeconfig_path().to_path_buf();
    let kc = kc.as_str();
    let shards = ["--shards=16", "--lease-duration=3s", "--renew-period=1s"];
    let mut hub_flags = vec![
        "--store=kube",
        "--kubeconfig",
        kc,
        "--gateways=external",
        "--metrics-addr=127.0.0.1:0",
    ];
    hub_flags.extend(shards);
    let hub = flotilla_e2e::Hub::start(d, &hub_flags).await?;
    let certs = hub.gateway_cert(d)?;
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let mut flags = vec![
        format!("--metrics-addr={metrics}"),
        "--log-format=json".into(),
    ];
    flags.extend(shards.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    // The store answers nothing until SIGCONT: the gateway cannot read the shard leases.
    let apiserver = Pid::from_raw(env.apiserver_pid() as i32);
    kill(apiserver, Signal::SIGSTOP)?;
    let started = GatewayProc::start(d, "gw-1", &kubeconfig, &certs, &flags);
    let cold = async {
        let gateway = started?;
        wait_for("the gateway alive", WAIT, || async {
            Ok((http_get(&metrics, "/healthz").await.ok().map(|r| r.0) == Some(200)).then_some(()))
        })
        .await
        .with_context(|| gateway.proc.log())?;
        let (status, body) = http_get(&metrics, "/readyz").await?;
        assert_eq!(status, 503, "{body}");
        assert!(
            body.contains("shard leases"),
            "/readyz does not say why: {body}"
        );
        // A cold gateway closes the connection at once; one that served would wait for the
        // ClientHello until its handshake timeout.
        closed_before_tls(&gateway.address).await?;
        let refused = [("outcome", "not_ready"), ("transport", "grpc")];
        wait_value(
            &metrics,
            "flotilla_gateway_new_connections_total",
            &refused,
            |v| v >= 1.0,
        )
        .await?;
        anyhow::Ok(gateway)
    }
    .await;
    // Never leave the apiserver stopped, whatever failed.
    let _ = kill(apiserver, Signal::SIGCONT);
    let gateway = cold?;

    wait_for("the gateway ready", WAIT, || async {
        Ok((http_get(&metrics, "/readyz").await?.0 == 200).then_some(()))
    })
    .await
    .with_context(|| gateway.proc.log())?;
    let owned = wait_value(&metrics, "flotilla_gateway_shards_owned", &[], |v| {
        v == 16.0
    })
    .await?;
    // Its store requests: once it holds shards, its two caches list them (nothing before).
    wait_value(
        &metrics,
        "flotilla_gateway_store_requests_total",
        &[("verb", "list")],
        |v| v >= 2.0,
    )
    .await?;
    let page = scrape(&metrics).await?;
    has_families(&page, &HUB_FAMILIES[..9]);
    has_families(&page, &KUBE_API_FAMILIES);
    let hub_metrics = hub.metrics_addr.clone().context("no hub metrics address")?;
    assert_eq!(
        value(&hub_metrics, "flotilla_gateway_shards_owned", &[]).await?,
        0.0,
        "gateway owns {owned}"
    );
    Ok(())
}

/// Connects to `address` and expects the connection closed (end of stream or reset) before a
/// byte of TLS is sent either way.
async fn closed_before_tls(address: &str) -> anyhow::Result<()> {
    use tokio::io::AsyncReadExt as _;
    let mut tcp = tokio::net::TcpStream::connect(address)
        .await
        .with_context(|| format!("connecting to {address}"))?;
    let mut byte = [0u8; 1];
    match tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut byte)).await {
        Ok(Ok(0)) | Ok(Err(_)) => Ok(()),
        Ok(Ok(_)) => anyhow::bail!("{address} sent bytes to a client that sent none"),
        Err(_) => anyhow::bail!("{address} kept the connection open for a TLS handshake"),
    }
}

/// The hub's placement and rollout gauges: a Placement that selects nobody is counted until a
/// label change gives it a decision; a ManifestWorkReplicaSet leaves `Pending` once its
/// controller has judged the rollout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_and_rollout_gauges_follow_the_fleet() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let fleet = Fleet::start_with(d, false, &["--metrics-addr=127.0.0.1:0"]).await?;
    let hub = fleet
        .hub
        .metrics_addr
        .clone()
        .context("no metrics address")?;
    fleet.hub.dev_cert("cluster1", &d.join("cluster1"))?;
    let _agent = start_agent(d, &fleet.hub, "cluster1", &d.join("cluster1"))?;
    wait_value(
        &hub,
        "flotilla_hub_managedclusters",
        &[("available", "True")],
        |v| v == 1.0,
    )
    .await?;
    assert_eq!(
        value(&hub, "flotilla_hub_placements_without_decisions", &[]).await?,
        0.0
    );

    fleet.apply(
        &workspace_root().join("proto/tests/fixtures/managedclustersetbinding_default.yaml"),
    )?;
    let by_label = serde_json::json!({"apiVersion": "cluster.open-cluster-management.io/v1beta1",
        "kind": "Placement", "metadata": {"name": "by-label", "namespace": "default"},
        "spec": {"predicates": [{"requiredClusterSelector": {"labelSelector": {"matchLabels": {"environment": "dev"}}}}]}});
    fleet.apply_value(d, &by_label)?;
    fleet.wait_decided("default", "by-label", &[]).await?;
    wait_value(
        &hub,
        "flotilla_hub_placements_without_decisions",
        &[],
        |v| v == 1.0,
    )
    .await?;
    fleet.cli(&["cluster", "label", "cluster1", "environment=dev"])?;
    fleet
        .wait_decided("default", "by-label", &["cluster1"])
        .await?;
    wait_value(
        &hub,
        "flotilla_hub_placements_without_decisions",
        &[],
        |v| v == 0.0,
    )
    .await?;

    // A replica set on that placement: counted in a phase other than Pending once judged.
    let judged = |page: &Exposition| {
        ["Progressing", "Complete", "MaxFailuresExceeded"]
            .iter()
            .map(|p| {
                page.value("flotilla_hub_rollouts", &[("phase", p)])
                    .unwrap_or(0.0)
            })
            .sum::<f64>()
    };
    assert_eq!(judged(&scrape(&hub).await?), 0.0);
    let manifests = d.join("manifests.yaml");
    std::fs::write(
        &manifests,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {namespace: default, name: web}\ndata: {k: v}\n",
    )?;
    fleet.cli(&[
        "work",
        "create",
        "web",
        "-f",
        manifests.to_str().unwrap_or_default(),
        "--placement",
        "default/by-label",
    ])?;
    wait_for("the rollout judged", WAIT, || async {
        let page = scrape(&hub).await?;
        Ok((judged(&page) == 1.0
            && page.value("flotilla_hub_rollouts", &[("phase", "Pending")]) == Some(0.0))
        .then_some(()))
    })
    .await?;
    Ok(())
}

/// An agent restarted with works in its cache is ready only once it has applied them: while
/// its spoke apiserver does not answer, `/readyz` is 503 and says so; `/healthz` answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_is_ready_once_its_cached_works_are_applied() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let fleet = Fleet::start(d, false).await?;
    let spoke = Spoke::start(d, &fleet.hub, "cluster1").await?;
    let address = format!("127.0.0.1:{}", free_port()?);
    let flags = [format!("--metrics-addr={address}")];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut agent = spoke.start_agent(d, &fleet.hub, &flags)?;
    fleet.apply(&workspace_root().join(SEED_WORK))?;
    fleet.wait_applied("cluster1", "my-first-work").await?;
    agent.signal_and_wait(Signal::SIGTERM);

    let apiserver = Pid::from_raw(spoke.env.apiserver_pid() as i32);
    kill(apiserver, Signal::SIGSTOP)?;
    let checked = async {
        let _agent = spoke.start_agent(d, &fleet.hub, &flags)?;
        let (status, body) = wait_for("the agent's probes", WAIT, || async {
            Ok(http_get(&address, "/readyz").await.ok())
        })
        .await?;
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("have not all been applied once"), "{body}");
        assert_eq!(http_get(&address, "/healthz").await?.0, 200);
        kill(apiserver, Signal::SIGCONT)?;
        wait_for("the agent ready once its spoke answers", WAIT, || async {
            Ok((http_get(&address, "/readyz").await?.0 == 200).then_some(()))
        })
        .await
    }
    .await;
    let _ = kill(apiserver, Signal::SIGCONT);
    checked
}
