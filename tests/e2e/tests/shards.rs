//! Scale-out mode end to end: a hub on a real kube-apiserver with `--gateways external`, three
//! `flotilla-gateway` processes dividing the shards through Leases, and real agents that all
//! dial the hub's address (standing in for a load balancer) and are redirected to their
//! shards' owners. One gateway is SIGKILLed: its shards move once their leases expire, its
//! agents are served by the new owners, no shard ever has two owners in the leases, no work
//! or status is lost, and no cluster is marked Unknown while its agent is around. Another is
//! stopped with SIGTERM: it drains its agents and releases its shards to the last one.
//! Throughout, each gateway's watch caches hold only its own shards' works and clusters (its
//! `flotilla_gateway_cached_objects`), and works applied with kubectl straight to the hub
//! apiserver, without the shard label, reach their agents because the hub labels them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;

use flotilla_e2e::{
    GatewayProc, Hub, condition_status, free_port, on_both_carriers, scrape, start_agent, wait_for,
};
use flotilla_proto::contract::{SHARD_LABEL, shard_label_value, shard_of, shard_of_lease};
use flotilla_testenv::{TestEnv, workspace_root};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tokio::sync::Mutex;

const SHARDS: u32 = 16;
const CLUSTERS: usize = 6;
/// Short leases, so shards move in seconds. The grace period must outlast what an agent of a
/// killed gateway takes to reach the shard's new owner once it took the shard over: until the
/// lease expires the hub still redirects the agent to the dead gateway, and over QUIC (no
/// refusal from a dead UDP port) that dial only ends at the agent's redirect dial timeout
/// (`flotilla_agent::connect::REDIRECT_DIAL_TIMEOUT`, 10 s), then a backoff step. As in
/// production (lease 15 s, grace 40 s), the grace period covers a lease, that dial and a step,
/// with room for a loaded machine.
const LEASE_FLAGS: &[&str] = &[
    "--shards=16",
    "--lease-duration=3s",
    "--renew-period=1s",
    "--grace-period=30s",
    "--drain-window=1s",
];

/// (holder, epoch) of every held shard lease.
async fn owners(leases: &Api<Lease>) -> anyhow::Result<BTreeMap<u32, (String, u32)>> {
    let list = leases
        .list(&ListParams::default().labels("flotilla.io/lease=shard"))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|l| {
            let shard = shard_of_lease(l.metadata.name.as_deref()?)?;
            let spec = l.spec?;
            let holder = spec.holder_identity.filter(|h| !h.is_empty())?;
            Some((shard, (holder, spec.lease_transitions.unwrap_or(0) as u32)))
        })
        .collect())
}

/// Samples the shard leases until `stop`: every epoch has one holder, and epochs only grow.
async fn sample_ownership(
    leases: Api<Lease>,
    stop: Arc<AtomicBool>,
    violations: Arc<Mutex<Vec<String>>>,
) -> usize {
    let mut seen: BTreeMap<(u32, u32), String> = BTreeMap::new();
    let mut latest: BTreeMap<u32, u32> = BTreeMap::new();
    let mut samples = 0;
    while !stop.load(Ordering::Relaxed) {
        if let Ok(now) = owners(&leases).await {
            samples += 1;
            for (shard, (holder, epoch)) in now {
                if let Some(other) = seen.insert((shard, epoch), holder.clone())
                    && other != holder
                {
                    violations.lock().await.push(format!(
                        "shard {shard} epoch {epoch} held by {other} and by {holder}"
                    ));
                }
                let last = latest.entry(shard).or_insert(epoch);
                if epoch < *last {
                    violations.lock().await.push(format!(
                        "shard {shard}: epoch went back from {last} to {epoch}"
                    ));
                }
                *last = epoch.max(*last);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    samples
}

/// Clusters whose ManagedCluster shows Available=Unknown (or False) now.
fn unavailable(hub: &Hub) -> anyhow::Result<Vec<String>> {
    Ok(hub
        .clusters()?
        .iter()
        .filter(|c| {
            condition_status(c, "ManagedClusterConditionAvailable").as_deref() != Some("True")
        })
        .filter_map(|c| c["metadata"]["name"].as_str().map(str::to_string))
        .collect())
}

/// A ManifestWork with one ConfigMap for `cluster`, applied with kubectl.
fn apply_work(
    env: &TestEnv,
    dir: &Path,
    cluster: &str,
    name: &str,
    value: &str,
) -> anyhow::Result<()> {
    let work = json!({
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": { "name": name, "namespace": cluster },
        "spec": { "workload": { "manifests": [{
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": name, "namespace": "default" },
            "data": { "value": value },
        }]}},
    });
    let path = dir.join(format!("{cluster}-{name}-{value}.json"));
    std::fs::write(&path, serde_json::to_vec(&work)?)?;
    let out = env.kubectl().arg("apply").arg("-f").arg(&path).output()?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Waits until every cluster's work `name` carries a status reported for its current
/// generation (the agents have no spoke apiserver, so the status says the apply failed: what
/// matters is that it arrives and is stored).
async fn wait_statuses(hub: &Hub, clusters: &[String], name: &str) -> anyhow::Result<()> {
    wait_for(
        &format!("status of work {name} on every cluster"),
        Duration::from_secs(60),
        || async {
            for cluster in clusters {
                let Some(work) = hub.work(cluster, name)? else {
                    return Ok(None);
                };
                let generation = work["metadata"]["generation"].as_i64();
                let reported = work["status"]["conditions"].as_array().is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c["type"] == "Applied" && c["observedGeneration"].as_i64() == generation
                    })
                });
                if !reported {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )
    .await
}

/// Whether each gateway's caches hold exactly the works and clusters of the shards it holds:
/// `works` names the works applied so far per cluster (the test's clusters are the fleet's
/// only ones). Every work must also carry its cluster's shard label, stamped by the hub.
async fn caches_hold_own_shards(
    leases: &Api<Lease>,
    gateways: &[(String, String)],
    clusters: &[String],
    works: usize,
    hub: &Hub,
) -> anyhow::Result<Option<()>> {
    for cluster in clusters {
        for name in ["before", "after", "last"].iter().take(works) {
            let Some(work) = hub.work(cluster, name)? else {
                return Ok(None);
            };
            let label = work["metadata"]["labels"][SHARD_LABEL].as_str();
            if label != Some(shard_label_value(shard_of(cluster, SHARDS)).as_str()) {
                return Ok(None);
            }
        }
    }
    let now = owners(leases).await?;
    for (name, metrics) in gateways {
        let mine = clusters
            .iter()
            .filter(|c| {
                now.get(&shard_of(c, SHARDS))
                    .is_some_and(|(h, _)| h == name)
            })
            .count();
        let page = scrape(metrics).await?;
        let cached = |kind: &str| {
            page.value("flotilla_gateway_cached_objects", &[("kind", kind)])
                .map(|v| v as usize)
        };
        if cached("ManagedCluster") != Some(mine) || cached("ManifestWork") != Some(mine * works) {
            return Ok(None);
        }
    }
    Ok(Some(()))
}

/// Every gateway's log, for a failure's context.
fn logs(gateways: &[GatewayProc]) -> String {
    gateways
        .iter()
        .map(|g| format!("--- {} ---\n{}", g.name, g.proc.log()))
        .collect()
}

/// Whether every cluster's session is on its shard's owner (and on no other gateway), and
/// every cluster is Available.
async fn on_owners(
    leases: &Api<Lease>,
    gateways: &[GatewayProc],
    clusters: &[String],
    hub: &Hub,
) -> anyhow::Result<Option<()>> {
    let now = owners(leases).await?;
    for cluster in clusters {
        let Some((owner, _)) = now.get(&shard_of(cluster, SHARDS)) else {
            return Ok(None);
        };
        let holding: Vec<&str> = gateways
            .iter()
            .filter(|g| g.sessions().contains(cluster))
            .map(|g| g.name.as_str())
            .collect();
        if holding != [owner.as_str()] {
            return Ok(None);
        }
    }
    Ok(unavailable(hub)?.is_empty().then_some(()))
}

on_both_carriers! {
    /// The acceptance scenario of sharded gateways, with real processes on a real apiserver.
    async fn sharded_gateways_take_over_a_killed_ones_agents() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let dir = dir.path();
        let env = TestEnv::start().await?;
        env.install_crds(&workspace_root().join("deploy/crds")).await?;
        let kubeconfig = env.kubeconfig_path().to_path_buf();
        let kc = kubeconfig.to_str().unwrap();
        let mut hub_flags = vec!["--store=kube", "--kubeconfig", kc, "--gateways=external"];
        hub_flags.extend(LEASE_FLAGS);
        let hub = Hub::start(dir, &hub_flags).await?;

        let certs = hub.gateway_cert(dir)?;
        // (name, metrics address) of every gateway alive.
        let mut scraped: Vec<(String, String)> = Vec::new();
        let mut gateways: Vec<GatewayProc> = (1..=3)
            .map(|n| {
                let name = format!("gw-{n}");
                let metrics = format!("127.0.0.1:{}", free_port()?);
                let mut flags = LEASE_FLAGS.to_vec();
                let flag = format!("--metrics-addr={metrics}");
                flags.push(&flag);
                let started = GatewayProc::start(dir, &name, &kubeconfig, &certs, &flags);
                scraped.push((name, metrics));
                started
            })
            .collect::<anyhow::Result<_>>()?;

        let leases: Api<Lease> = Api::namespaced(env.client().await?, "flotilla-system");
        let stop = Arc::new(AtomicBool::new(false));
        let violations = Arc::new(Mutex::new(Vec::new()));
        let sampler = tokio::spawn(sample_ownership(leases.clone(), stop.clone(), violations.clone()));

        // Every shard owned, no gateway above its fair share.
        wait_for("the shards divided among three gateways", Duration::from_secs(60), || async {
            let now = owners(&leases).await?;
            let mut per: BTreeMap<String, usize> = BTreeMap::new();
            for (holder, _) in now.values() {
                *per.entry(holder.clone()).or_default() += 1;
            }
            Ok((now.len() == SHARDS as usize && per.len() == 3 && per.values().all(|&n| n <= 6)).then_some(()))
        })
        .await
        .with_context(|| logs(&gateways))?;

        let clusters: Vec<String> = (0..CLUSTERS).map(|i| format!("store-{i:02}")).collect();
        let mut agents = Vec::new();
        for cluster in &clusters {
            let cert_dir = dir.join(format!("cert-{cluster}"));
            hub.dev_cert(cluster, &cert_dir)?;
            agents.push(start_agent(dir, &hub, cluster, &cert_dir)?);
        }

        // Every agent ends on its shard's owner, every cluster Available.
        wait_for("every agent on its shard's owner, every cluster Available", Duration::from_secs(60), || {
            on_owners(&leases, &gateways, &clusters, &hub)
        })
        .await
        .with_context(|| {
            let agent_logs: String = agents.iter().map(|a| format!("--- agent ---\n{}", a.log())).collect();
            format!("--- hub ---\n{}\n{}{agent_logs}\nunavailable: {:?}", hub.proc.log(), logs(&gateways), unavailable(&hub))
        })?;
        // The hub redirected them: they all dialled its address first.
        let redirected = agents.iter().filter(|a| a.log().contains("redirected to the gateway")).count();
        assert_eq!(redirected, CLUSTERS, "every agent was redirected from the hub's address");

        // Applied with kubectl, without the shard label: the hub labels them, and only then
        // does the gateway holding the shard see them.
        for cluster in &clusters {
            apply_work(&env, dir, cluster, "before", "1")?;
        }
        wait_statuses(&hub, &clusters, "before").await?;
        wait_for("each gateway caching only its shards' works and clusters", Duration::from_secs(30), || {
            caches_hold_own_shards(&leases, &scraped, &clusters, 1, &hub)
        })
        .await
        .with_context(|| logs(&gateways))?;

        // Kill the gateway holding the most of our clusters' sessions.
        let victim = (0..gateways.len())
            .max_by_key(|&i| gateways[i].sessions().len())
            .expect("three gateways");
        let victim_name = gateways[victim].name.clone();
        let its_shards: BTreeSet<u32> = owners(&leases)
            .await?
            .into_iter()
            .filter(|(_, (h, _))| *h == victim_name)
            .map(|(s, _)| s)
            .collect();
        let its_clusters = gateways[victim].sessions();
        assert!(!its_clusters.is_empty(), "the victim serves someone");
        gateways[victim].proc.signal_and_wait(Signal::SIGKILL);
        let killed = gateways.remove(victim);
        scraped.retain(|(name, _)| *name != victim_name);

        // From now on availability is sampled: nobody may turn Unknown, their agents are around.
        let mut seen_unavailable = BTreeSet::new();
        wait_for("the killed gateway's shards taken over", Duration::from_secs(30), || {
            seen_unavailable.extend(unavailable(&hub).unwrap_or_default());
            let (leases, its_shards, victim_name) = (&leases, &its_shards, &victim_name);
            async move {
            let now = owners(leases).await?;
            Ok(its_shards
                .iter()
                .all(|s| now.get(s).is_some_and(|(h, _)| h != victim_name))
                .then_some(()))
            }
        })
        .await?;
        wait_for("every agent on its shard's new owner", Duration::from_secs(60), || {
            let bad = unavailable(&hub).unwrap_or_default();
            seen_unavailable.extend(bad);
            on_owners(&leases, &gateways, &clusters, &hub)
        })
        .await?;
        assert!(
            seen_unavailable.is_empty(),
            "clusters marked unavailable while their agents reconnected: {seen_unavailable:?}\nkilled gateway log:\n{}",
            killed.proc.log()
        );

        // Work after the takeover reaches every agent, and every status comes back.
        for cluster in &clusters {
            apply_work(&env, dir, cluster, "after", "2")?;
        }
        wait_statuses(&hub, &clusters, "after").await?;
        wait_statuses(&hub, &clusters, "before").await?;
        // The survivors re-selected their watches for the shards they took over.
        wait_for("each survivor caching only its shards' works and clusters", Duration::from_secs(30), || {
            caches_hold_own_shards(&leases, &scraped, &clusters, 2, &hub)
        })
        .await
        .with_context(|| logs(&gateways))?;

        // A gateway stopped with SIGTERM hands over cleanly: it drains its agents with a
        // retry-after and releases its shards on the way out, so the last gateway takes them
        // without waiting for expiry, and again nobody turns Unknown.
        let mut stopping = gateways.remove(0);
        let drained_clusters = stopping.sessions();
        stopping.proc.signal_and_wait(Signal::SIGTERM);
        let log = stopping.proc.log();
        assert!(log.contains("shards released on shutdown"), "{log}");
        wait_for("every agent on the last gateway", Duration::from_secs(60), || {
            seen_unavailable.extend(unavailable(&hub).unwrap_or_default());
            on_owners(&leases, &gateways, &clusters, &hub)
        })
        .await?;
        assert!(seen_unavailable.is_empty(), "{seen_unavailable:?}");
        assert_eq!(owners(&leases).await?.len(), SHARDS as usize);
        for (cluster, agent) in clusters.iter().zip(&agents) {
            if drained_clusters.contains(cluster) {
                assert!(
                    agent.log().contains("draining this session"),
                    "{cluster} was drained, not dropped"
                );
            }
        }
        for cluster in &clusters {
            apply_work(&env, dir, cluster, "last", "3")?;
        }
        wait_statuses(&hub, &clusters, "last").await?;

        // A work whose shard label changes under its gateway (the hub's labeller correcting a
        // label after an upgrade or a change of --shards) leaves that gateway's selected watch
        // as if deleted; its agent must keep it. The hub is frozen so the wrong label stays
        // until the gateway has seen it.
        let cluster = &clusters[0];
        let owner = gateways
            .iter()
            .find(|g| g.sessions().contains(cluster))
            .context("the owner of the first cluster")?;
        kill(Pid::from_raw(hub.proc.pid() as i32), Signal::SIGSTOP)?;
        let relabel = env
            .kubectl()
            .args(["label", "--overwrite", "manifestwork", "last", "-n", cluster, "flotilla.io/shard=99"])
            .output()?;
        let seen = wait_for("the relabelled work to leave its gateway's cache", Duration::from_secs(30), || async {
            Ok(owner.proc.log().contains("its shard label changed): its agent keeps it").then_some(()))
        })
        .await;
        kill(Pid::from_raw(hub.proc.pid() as i32), Signal::SIGCONT)?;
        anyhow::ensure!(relabel.status.success(), "kubectl label: {}", String::from_utf8_lossy(&relabel.stderr));
        seen?;
        // The hub labels it back; a new version then reaches the agent, after anything the
        // gateway sent before: no deletion among it.
        apply_work(&env, dir, cluster, "last", "4")?;
        wait_statuses(&hub, std::slice::from_ref(cluster), "last").await?;
        let agent = &agents[0];
        assert!(
            !agent.log().contains("work deleted on the hub"),
            "the agent deleted a work whose label changed:\n{}",
            agent.log()
        );

        stop.store(true, Ordering::Relaxed);
        let samples = sampler.await?;
        assert!(samples > 10, "ownership sampled throughout ({samples} samples)");
        let violations = violations.lock().await;
        assert!(violations.is_empty(), "{violations:?}");
        Ok(())
    }
}
