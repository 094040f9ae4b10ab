//! The status page in scale-out mode: a hub on a real kube-apiserver with `--gateways
//! external`, two `flotilla-gateway` processes dividing the shards by Leases, and two real
//! agents, one on each carrier, redirected by the hub to their shards' owners. The hub holds
//! no session, yet its page (`/ui/api/clusters`, through the operator API) shows each
//! connected cluster's transport and last-seen time, learnt from the gateways over the relay
//! service; once the agent processes are killed (SIGKILL: no goodbye), it shows them
//! disconnected with the time their gateways saw their sessions end.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_cli::client::{OperatorClient, OperatorConfig};
use flotilla_e2e::{Carrier, GatewayProc, Hub, Proc, start_agent, wait_for};
use flotilla_testenv::{TestEnv, workspace_root};
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams};
use nix::sys::signal::Signal;
use serde_json::Value;

const SHARDS: usize = 16;
const LEASE_FLAGS: &[&str] = &[
    "--shards=16",
    "--lease-duration=3s",
    "--renew-period=1s",
    "--grace-period=6s",
    "--drain-window=1s",
];
/// How long a step may take on a loaded machine: leases divided, agents redirected.
const WAIT: Duration = Duration::from_secs(60);

/// The page's rows of `clusters`, by name, as its JSON API gives them.
async fn rows(
    client: &OperatorClient,
    clusters: &[(&str, Carrier)],
) -> anyhow::Result<BTreeMap<String, Value>> {
    let (status, page) = client
        .request(http::Method::GET, "/ui/api/clusters?limit=500", None)
        .await?;
    anyhow::ensure!(status.is_success(), "GET /ui/api/clusters: {status} {page}");
    Ok(page["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|row| {
            let name = row["name"].as_str()?;
            clusters
                .iter()
                .any(|(c, _)| *c == name)
                .then(|| (name.to_string(), row.clone()))
        })
        .collect())
}

/// How many shard leases each gateway holds now.
async fn shards_held(leases: &Api<Lease>) -> anyhow::Result<BTreeMap<String, usize>> {
    let list = leases
        .list(&ListParams::default().labels("flotilla.io/lease=shard"))
        .await?;
    let mut held = BTreeMap::new();
    for holder in list
        .items
        .into_iter()
        .filter_map(|l| l.spec?.holder_identity.filter(|h| !h.is_empty()))
    {
        *held.entry(holder).or_default() += 1;
    }
    Ok(held)
}

/// A row's time field, if the page shows one.
fn time(row: &Value, field: &str) -> Option<Timestamp> {
    row[field].as_str()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_sessions_held_by_external_gateways() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let dir = dir.path();
    let env = TestEnv::start().await?;
    env.install_crds(&workspace_root().join("deploy/crds"))
        .await?;
    let kubeconfig = env.kubeconfig_path().to_path_buf();
    let kc = kubeconfig.to_str().unwrap();
    let mut flags = vec!["--store=kube", "--kubeconfig", kc, "--gateways=external"];
    flags.extend(LEASE_FLAGS);
    let mut hub = Hub::start(dir, &flags).await?;
    let certs = hub.gateway_cert(dir)?;
    let gateways: Vec<GatewayProc> = (1..=2)
        .map(|n| GatewayProc::start(dir, &format!("gw-{n}"), &kubeconfig, &certs, LEASE_FLAGS))
        .collect::<anyhow::Result<_>>()?;
    let client = OperatorClient::new(&OperatorConfig::load(
        &hub.data_dir.join("operator/config.yaml"),
    )?)?;
    // The shards divided before any agent comes: a shard that moves later takes its
    // cluster's session to a gateway that never saw it end, which can say nothing of it.
    let leases: Api<Lease> = Api::namespaced(env.client().await?, "flotilla-system");
    wait_for("the shards divided between two gateways", WAIT, || async {
        let held = shards_held(&leases).await?;
        Ok((held.len() == 2 && held.values().all(|&n| n == SHARDS / 2)).then_some(()))
    })
    .await?;

    // One agent per carrier, both dialling the hub's address and sent on to their owners.
    let clusters = [("store-grpc", Carrier::Grpc), ("store-quic", Carrier::Quic)];
    let mut agents: Vec<Proc> = Vec::new();
    for (cluster, carrier) in clusters {
        hub.carrier = carrier;
        let cert_dir = dir.join(format!("cert-{cluster}"));
        hub.dev_cert(cluster, &cert_dir)?;
        agents.push(start_agent(dir, &hub, cluster, &cert_dir)?);
    }
    let logs = |agents: &[Proc]| -> String {
        let gateways: String = gateways
            .iter()
            .map(|g| format!("--- {} ---\n{}", g.name, g.proc.log()))
            .collect();
        let agents: String = agents
            .iter()
            .map(|a| format!("--- agent ---\n{}", a.log()))
            .collect();
        format!("--- hub ---\n{}\n{gateways}{agents}", hub.proc.log())
    };

    // Connected: the row says so, with the carrier the agent chose and a last-seen time.
    let connected = wait_for(
        "both clusters connected on the page, with their transport",
        WAIT,
        || async {
            let rows = rows(&client, &clusters).await?;
            let all = clusters.iter().all(|(cluster, carrier)| {
                rows.get(*cluster).is_some_and(|row| {
                    row["connected"] == true
                        && row["transport"] == carrier.to_string()
                        && time(row, "lastSeen").is_some()
                        && time(row, "sessionSince").is_some()
                })
            });
            Ok(all.then_some(rows))
        },
    )
    .await
    .with_context(|| logs(&agents))?;
    // The sessions really are on the gateways: the hub sent both agents away.
    for agent in &agents {
        assert!(
            agent.log().contains("redirected to the gateway"),
            "{}",
            agent.log()
        );
    }
    let held: usize = gateways.iter().map(|g| g.sessions().len()).sum();
    assert_eq!(held, clusters.len(), "{}", logs(&agents));

    // Killed without a goodbye: each owner notices (a reset over TCP, missed heartbeats over
    // QUIC) and the page shows the cluster gone, last seen when its session ended there.
    let killed = Timestamp::now();
    for agent in &mut agents {
        agent.signal_and_wait(Signal::SIGKILL);
    }
    let departed = wait_for(
        "both clusters disconnected on the page, with when they were last seen",
        WAIT,
        || async {
            let rows = rows(&client, &clusters).await?;
            let all = clusters.iter().all(|(cluster, _)| {
                rows.get(*cluster).is_some_and(|row| {
                    row["connected"] == false
                        && row["transport"].is_null()
                        && time(row, "lastSeen").is_some()
                })
            });
            Ok(all.then_some(rows))
        },
    )
    .await
    .with_context(|| logs(&agents))?;
    for (cluster, _) in clusters {
        let (before, after) = (&connected[cluster], &departed[cluster]);
        let since = time(before, "sessionSince").expect("checked above");
        let last_seen = time(after, "lastSeen").expect("checked above");
        // The session's end as its gateway recorded it, after the kill: not the start of the
        // session, nor the page's "now" of an earlier render.
        assert!(
            last_seen >= killed && last_seen > since,
            "{cluster}: last seen {last_seen}, killed at {killed}, session since {since}"
        );
        assert!(after["sessionSince"].is_null(), "{cluster}: {after}");
    }
    Ok(())
}
