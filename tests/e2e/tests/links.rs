//! Agents behind emulated wide-area links (`flotilla-wan`): the agent process runs in the
//! link's network namespace and reaches the hub only across the link; its spoke's apiserver, as
//! at an edge site, is beside it (served in the namespace without crossing the link). Needs
//! root and the tools `flotilla_wan::check_available` names; where they are missing each test
//! says it is skipped and why.
//!
//! The hub keeps its default heartbeat (10 s), heartbeat timeout (30 s) and grace (40 s) unless
//! a test says why not: what is checked is that the product's own settings hold over these
//! links.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_e2e::proxy::{hub_with_proxy, kubectl_ok};
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{
    Fleet, Hub, bin, condition_status, free_port, on_both_carriers, scrape, scrape_behind,
    start_agent_behind, wait_for,
};
use flotilla_hub::config::{
    DEFAULT_GRACE_PERIOD, DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_TIMEOUT,
};
use flotilla_proto::api::content::CHUNK_BYTES;
use flotilla_wan::{EmulatedLink, Profile};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

const AVAILABLE: &str = "ManagedClusterConditionAvailable";
/// The longest a step over a link may take: a TLS handshake and a few round trips at 300 ms
/// with 3 % loss, or a 10 s outage and what it delays.
const WAIT: Duration = Duration::from_secs(90);
/// How often the Available condition is read while a test runs.
const AVAILABILITY_POLL: Duration = Duration::from_millis(250);

/// The hub's own defaults, in place of the fast ones the e2e hubs get otherwise.
fn default_health() -> [String; 3] {
    [
        format!("--heartbeat-interval={DEFAULT_HEARTBEAT_INTERVAL}"),
        format!("--heartbeat-timeout={DEFAULT_HEARTBEAT_TIMEOUT}"),
        format!("--grace-period={DEFAULT_GRACE_PERIOD}"),
    ]
}

/// Whether links can be made here; where not, the test skips, saying why.
fn links_available() -> bool {
    match flotilla_wan::check_available() {
        Ok(()) => true,
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            false
        }
    }
}

/// The Available condition of `cluster` as the hub shows it: its status and lastTransitionTime.
async fn available_now(config: &Path, cluster: &str) -> anyhow::Result<Option<(String, String)>> {
    let out = tokio::process::Command::new(bin("flotilla"))
        .env("FLOTILLA_CONFIG", config)
        .args(["get", "clusters", "-o", "json"])
        .kill_on_drop(true)
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "flotilla get clusters: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout)?;
    let condition = list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["metadata"]["name"] == cluster)
        .and_then(|c| c["status"]["conditions"].as_array())
        .and_then(|cs| cs.iter().find(|c| c["type"] == AVAILABLE));
    Ok(condition.map(|c| {
        let text = |field: &str| c[field].as_str().unwrap_or_default().to_string();
        (text("status"), text("lastTransitionTime"))
    }))
}

/// Every state a cluster's Available condition was seen in from [`AvailabilityRecord::start`]
/// on: each change of status or of lastTransitionTime, in order. A transition sets the
/// condition's lastTransitionTime, so one between two reads still shows in the second, and a
/// record of one state from start to finish means no transition at all in between.
struct AvailabilityRecord {
    stop: tokio::sync::oneshot::Sender<()>,
    poller: JoinHandle<anyhow::Result<Vec<(String, String)>>>,
}

impl AvailabilityRecord {
    /// Starts recording once the cluster is Available, as it must be before.
    async fn start(hub: &Hub, cluster: &str) -> anyhow::Result<AvailabilityRecord> {
        let config = hub.data_dir.join("operator/config.yaml");
        let first = available_now(&config, cluster).await?;
        anyhow::ensure!(
            first.as_ref().is_some_and(|(status, _)| status == "True"),
            "{cluster} is not Available when the record starts: {first:?}"
        );
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let cluster = cluster.to_string();
        let poller = tokio::spawn(async move {
            let mut seen: Vec<(String, String)> = first.into_iter().collect();
            loop {
                let finishing = tokio::select! {
                    _ = &mut stopped => true,
                    () = tokio::time::sleep(AVAILABILITY_POLL) => false,
                };
                // A read that fails (a busy machine) is only a gap: the next one still shows
                // a transition made in it, by its lastTransitionTime. The last must succeed.
                match available_now(&config, &cluster).await {
                    Ok(Some(state)) if seen.last() != Some(&state) => seen.push(state),
                    Ok(None) if finishing => anyhow::bail!("{cluster} has no Available condition"),
                    Err(e) if finishing => return Err(e),
                    _ => {}
                }
                if finishing {
                    return Ok(seen);
                }
            }
        });
        Ok(AvailabilityRecord { stop, poller })
    }

    /// Stops recording after one last read, and returns every state seen.
    async fn finish(self) -> anyhow::Result<Vec<(String, String)>> {
        let _ = self.stop.send(());
        self.poller.await?
    }
}

/// Asserts that `cluster` was Available from the record's start to its end, with no transition
/// in between, and that the hub never logged it Unknown.
async fn assert_never_unavailable(
    record: AvailabilityRecord,
    hub: &Hub,
    cluster: &str,
) -> anyhow::Result<()> {
    let seen = record.finish().await?;
    assert!(
        seen.len() == 1 && seen[0].0 == "True",
        "{cluster}'s Available condition changed while its agent was connected: {seen:?}"
    );
    let unknown = hub
        .proc
        .log()
        .lines()
        .filter(|l| l.contains("cluster unknown") && l.contains(cluster))
        .map(str::to_string)
        .collect::<Vec<_>>();
    assert!(
        unknown.is_empty(),
        "the hub marked {cluster} Unknown: {unknown:?}"
    );
    Ok(())
}

/// A ManifestWork `name` for `cluster`: one ConfigMap of the same name in `default` saying
/// `greeting`, whose data the hub is told back as status feedback.
fn greeting_work(cluster: &str, name: &str, greeting: &str) -> Value {
    json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": name, "namespace": cluster},
        "spec": {
            "workload": {"manifests": [{
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": "default"},
                "data": {"greeting": greeting},
            }]},
            "manifestConfigs": [{
                "resourceIdentifier": {"group": "", "resource": "configmaps", "namespace": "default", "name": name},
                "feedbackRules": [{"type": "JSONPaths", "jsonPaths": [{"name": "greeting", "path": ".data.greeting"}]}],
            }],
        },
    })
}

/// The `greeting` feedback value of work `name`'s ConfigMap, as the hub stores it.
fn greeting_feedback(work: &Value, name: &str) -> Option<Value> {
    work["status"]["resourceStatus"]["manifests"]
        .as_array()?
        .iter()
        .find(|m| m["resourceMeta"]["name"] == name)?["statusFeedback"]["values"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == "greeting")
        .map(|v| v["fieldValue"].clone())
}

/// Applies [`greeting_work`] through the hub and waits until its ConfigMap is on the spoke and
/// the hub has its status: Applied and Available, and the greeting fed back.
async fn deliver_greeting(
    fleet: &Fleet,
    dir: &Path,
    spoke: &Spoke,
    name: &str,
    greeting: &str,
) -> anyhow::Result<()> {
    fleet.apply_value(dir, &greeting_work(&spoke.name, name, greeting))?;
    wait_for(&format!("ConfigMap {name} on the spoke"), WAIT, || async {
        let cm = spoke.config_map("default", name).await?;
        let said = cm.and_then(|cm| cm.data?.get("greeting").cloned());
        Ok((said.as_deref() == Some(greeting)).then_some(()))
    })
    .await?;
    let work = wait_for(
        &format!("work {name}'s status on the hub"),
        WAIT,
        || async {
            let work = fleet.work(&spoke.name, name)?;
            Ok(work.filter(|w| {
                condition_status(w, "Applied").as_deref() == Some("True")
                    && condition_status(w, "Available").as_deref() == Some("True")
                    && greeting_feedback(w, name).is_some()
            }))
        },
    )
    .await?;
    assert_eq!(
        greeting_feedback(&work, name),
        Some(json!({"type": "String", "string": greeting})),
        "{work:#}"
    );
    Ok(())
}

/// Access rules of the hub's proxy front: group ops may do anything on `store-3`.
const RULES: &str = "
rules:
  - name: ops-store-3
    groups: [ops]
    clusters: {names: [store-3]}
    access: full
";

on_both_carriers! {
    /// Issue 28's acceptance over `congested` (300 ms ± 100, 3 % loss, 2 Mbit/s): a work
    /// delivered to the spoke, its status and feedback back on the hub, `kubectl get` of its
    /// object through the hub's tunnel, and the cluster Available throughout.
    async fn over_a_congested_link_works_statuses_and_kubectl_arrive_and_the_cluster_stays_available() -> anyhow::Result<()> {
        if !links_available() {
            return Ok(());
        }
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let health = default_health();
        let health: Vec<&str> = health.iter().map(String::as_str).collect();
        let hub = hub_with_proxy(d, RULES, "", &health).await?;
        let link = EmulatedLink::create(Profile::Congested.spec(), 281).await?;
        let spoke = Spoke::start(d, &hub, "store-3").await?;
        // The spoke's RBAC: the hub's kubectl users of group ops read ConfigMaps there.
        let admin = spoke.env.client().await?;
        Api::<ClusterRole>::all(admin.clone())
            .create(&PostParams::default(), &serde_json::from_value(json!({
                "metadata": {"name": "ops-reader"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}],
            }))?)
            .await?;
        Api::<ClusterRoleBinding>::all(admin)
            .create(&PostParams::default(), &serde_json::from_value(json!({
                "metadata": {"name": "ops-reader"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ops-reader"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "ops"}],
            }))?)
            .await?;
        let agent = spoke.start_agent_behind(&link, d, &hub, &["--feedback-interval=1s"]).await?;
        wait_for("store-3 Available across the link", WAIT, || async {
            Ok((hub.cluster_condition("store-3", AVAILABLE)?.as_deref() == Some("True")).then_some(()))
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\nthe agent's log:\n{}", agent.proc.log()))?;
        let record = AvailabilityRecord::start(&hub, "store-3").await?;
        let fleet = Fleet { hub, hub_env: None };

        deliver_greeting(&fleet, d, &spoke, "greeting", "hello over a congested link").await?;

        // The object through the hub's tunnel to the agent, which reads its spoke beside it.
        let alice = fleet.hub.create_user(d, "alice", &["ops"])?;
        let got = kubectl_ok(&alice, &["get", "configmap", "greeting", "-n", "default", "-o", "json"]).await?;
        let got: Value = serde_json::from_str(&got)?;
        assert_eq!(got["data"]["greeting"], "hello over a congested link", "{got:#}");

        // The session crossed the link both ways; the spoke was reached beside it.
        assert!(link.inbound().delivered > 0 && link.outbound().delivered > 0);
        assert!(agent.beside.accepted() > 0, "the agent never reached its apiserver beside the link");
        assert_never_unavailable(record, &fleet.hub, "store-3").await?;
        Ok(())
    }
}

/// `count` ConfigMaps of ~100 KiB each, saying `tag`: a work of its own content per tag.
fn bundle(dir: &Path, tag: &str, count: usize) -> anyhow::Result<std::path::PathBuf> {
    let docs: Vec<String> = (0..count)
        .map(|i| {
            serde_json::to_string(&json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("{tag}-{i:02}"), "namespace": "default"},
                "data": {"blob": format!("{tag}-{i:02} ").repeat(100 * 1024 / (tag.len() + 4))},
            }))
        })
        .collect::<Result<_, _>>()?;
    let path = dir.join(format!("{tag}.yaml"));
    std::fs::write(&path, docs.join("\n---\n"))?;
    Ok(path)
}

/// The agent's counter or gauge `name`, scraped from inside the link's namespace.
async fn agent_metric(link: &EmulatedLink, port: u16, name: &str) -> anyhow::Result<f64> {
    Ok(scrape_behind(link, port)
        .await?
        .value(name, &[])
        .unwrap_or(0.0))
}

on_both_carriers! {
    /// Issue 28's acceptance over `flapping` (lte, up 50 s then down 10 s, over and over): a
    /// work delivered; a chunked work whose transfer is cut by an outage after its first
    /// chunks are stored and completes after it without a chunk that had arrived sent again;
    /// the cluster Available across the outage and the profile's own flap; the session back
    /// after it (a work delivered after the flap).
    async fn over_a_flapping_link_a_chunked_work_resumes_and_the_cluster_stays_available() -> anyhow::Result<()> {
        if !links_available() {
            return Ok(());
        }
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let mut flags = default_health().to_vec();
        flags.push("--metrics-addr=127.0.0.1:0".into());
        // Chunks paced to 256 KiB/s per session (the lowest accepted is 64 KiB/s): the
        // transfer lasts long enough for the test to cut it after its first chunks, whatever
        // the machine's speed; the link itself would carry it in under 2 s.
        flags.push("--chunk-bytes-per-second=262144".into());
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let fleet = Fleet::start_with(d, false, &flags).await?;
        let hub_metrics = fleet.hub.metrics_addr.clone().context("the hub wrote no metrics address")?;
        let link = EmulatedLink::create(Profile::Flapping.spec(), 282).await?;
        let flap = link.spec().flap.context("the flapping profile flaps")?;
        let spoke = Spoke::start(d, &fleet.hub, "store-4").await?;
        // The agent's metrics on the namespace's own loopback, scraped from inside.
        let agent_port = free_port()?;
        let metrics_flag = format!("--metrics-addr=127.0.0.1:{agent_port}");
        let agent = spoke
            .start_agent_behind(&link, d, &fleet.hub, &["--feedback-interval=1s", &metrics_flag])
            .await?;
        wait_for("store-4 Available across the link", WAIT, || async {
            Ok((fleet.hub.cluster_condition("store-4", AVAILABLE)?.as_deref() == Some("True")).then_some(()))
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\nthe agent's log:\n{}", agent.proc.log()))?;
        let record = AvailabilityRecord::start(&fleet.hub, "store-4").await?;

        deliver_greeting(&fleet, d, &spoke, "before", "hello before the flap").await?;

        // 40 ConfigMaps of ~100 KiB: 4 MiB in 8 chunks.
        let file = bundle(d, "large", 40)?;
        let said = fleet.cli(&["work", "create", "large", "-f", file.to_str().unwrap(), "--clusters", "store-4"])?;
        assert!(said.contains("(chunked:"), "{said}");
        let stored = fleet.work("store-4", "large")?.context("the chunked work is stored")?;
        let content = &stored["spec"]["workload"]["manifests"][0]["content"];
        let content_bytes = content["bytes"].as_u64().context("content bytes")?;
        let chunk_count = content["chunks"].as_array().map_or(0, Vec::len);
        assert!(chunk_count >= 4, "{content_bytes} bytes in {chunk_count} chunks");

        // The outage this test drives: once the first two chunks are stored (acknowledged:
        // the agent asks only for what its cache lacks), the link goes down for as long as
        // the profile's flaps last, and comes back.
        let held_at_cut = wait_for("the first chunks stored by the agent", WAIT, || async {
            let held = agent_metric(&link, agent_port, "flotilla_agent_chunks_held").await?;
            Ok((held >= 2.0).then_some(held))
        })
        .await?;
        link.set_down(true).await?;
        assert!(
            (held_at_cut as usize) < chunk_count,
            "the transfer was over before the cut ({held_at_cut} of {chunk_count} chunks held)"
        );
        // The outage's length is the fault itself, not a wait for anything.
        tokio::time::sleep(flap.down).await;
        link.set_down(false).await?;
        let work = fleet.wait_applied("store-4", "large").await?;
        let manifests = work["status"]["resourceStatus"]["manifests"].as_array().map_or(0, Vec::len);
        assert_eq!(manifests, 40, "status names every ConfigMap of the chunked work");
        assert!(spoke.config_map("default", "large-39").await?.is_some(), "the last ConfigMap is on the spoke");
        // Not a chunk that had arrived was sent again: the agent counts any it already held,
        // and the hub sent the content once, plus at most the chunks in flight (asked for,
        // not yet stored) each time a session ended.
        assert_eq!(agent_metric(&link, agent_port, "flotilla_agent_chunks_received_again_total").await?, 0.0);
        let hub_page = scrape(&hub_metrics).await?;
        let sent = hub_page.value("flotilla_gateway_chunk_bytes_sent_total", &[]).unwrap_or(0.0);
        let reconnects = hub_page.value("flotilla_gateway_session_reconnects_total", &[]).unwrap_or(0.0);
        let in_flight = (flotilla_proto::session::CHUNK_WINDOW * CHUNK_BYTES) as f64;
        assert!(
            sent >= content_bytes as f64 && sent <= content_bytes as f64 + reconnects * in_flight,
            "the hub sent {sent} chunk bytes for {content_bytes} of content over {reconnects} reconnects"
        );
        eprintln!("{content_bytes} bytes in {chunk_count} chunks, {held_at_cut} held at the cut; the hub sent {sent} chunk bytes; {reconnects} reconnects");

        // The profile's own flap: wait for it to come and go.
        wait_for("the profile's flap to take the link down", flap.every + WAIT, || async {
            Ok(link.is_down().then_some(()))
        })
        .await?;
        wait_for("the profile's flap to end", WAIT, || async { Ok((!link.is_down()).then_some(())) }).await?;
        // The session is back: a work created after the flap is delivered, its status back.
        deliver_greeting(&fleet, d, &spoke, "after", "hello after the flap").await?;
        assert_never_unavailable(record, &fleet.hub, "store-4").await?;
        Ok(())
    }
}

on_both_carriers! {
    async fn an_agent_behind_a_congested_link_is_available_unknown_when_cut_and_back_after() -> anyhow::Result<()> {
        if !links_available() {
            return Ok(());
        }
        let dir = tempfile::tempdir()?;
        // Heartbeats and grace shorter than the defaults, for the cut to show within the test,
        // and longer than the e2e hubs' fast ones: 300 ms ± 100 round trips with 3 % loss
        // each way. This test has no spoke: the session is all its agent does.
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
