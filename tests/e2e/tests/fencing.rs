//! Fencing the store enforces, with real processes: a hub on a real kube-apiserver with
//! `--gateways external`, two `flotilla-gateway`s sharing the shards through Leases, and a real
//! agent applying to a real spoke apiserver. Gateway A's status write for the agent's work is
//! parked at its fault point (after its own fence check, before the store call), A is stopped
//! with SIGSTOP past its lease, B takes the shard, the agent moves to B and B stores a newer
//! status; A is continued and its write released: the store refuses it (`stale_epoch`), A
//! counts it and says so in its log, and the work's status is B's.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{GatewayProc, Hub, free_port, scrape, wait_for};
use flotilla_proto::contract::{shard_lease_name, shard_of};
use flotilla_testenv::{TestEnv, workspace_root};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::{Patch, PatchParams};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

const SHARDS: u32 = 16;
const LEASE_FLAGS: &[&str] = &[
    "--shards=16",
    "--lease-duration=3s",
    "--renew-period=1s",
    "--grace-period=6s",
    "--drain-window=1s",
];
const WORK: &str = "fenced";
const WAIT: Duration = Duration::from_secs(90);

/// (holder, epoch) of `shard`'s Lease.
async fn lease_of(leases: &Api<Lease>, shard: u32) -> anyhow::Result<Option<(String, u32)>> {
    let Some(lease) = leases.get_opt(&shard_lease_name(shard)).await? else {
        return Ok(None);
    };
    let Some(spec) = lease.spec else {
        return Ok(None);
    };
    Ok(spec
        .holder_identity
        .filter(|h| !h.is_empty())
        .map(|h| (h, spec.lease_transitions.unwrap_or(0) as u32)))
}

/// The work: a Deployment whose ready replicas come back as status feedback, so the spoke can
/// make the work's status change by changing the Deployment's status.
fn apply_work(env: &TestEnv, dir: &Path, cluster: &str) -> anyhow::Result<()> {
    let work = json!({
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": { "name": WORK, "namespace": cluster },
        "spec": {
            "workload": { "manifests": [{
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": { "name": "web", "namespace": "default" },
                "spec": {
                    "replicas": 3,
                    "selector": { "matchLabels": { "app": "web" } },
                    "template": {
                        "metadata": { "labels": { "app": "web" } },
                        "spec": { "containers": [{ "name": "web", "image": "nginx:1.27" }] },
                    },
                },
            }]},
            "manifestConfigs": [{
                "resourceIdentifier": { "group": "apps", "resource": "deployments", "namespace": "default", "name": "web" },
                "feedbackRules": [{ "type": "WellKnownStatus" }],
            }],
        },
    });
    let path = dir.join("fenced-work.json");
    std::fs::write(&path, serde_json::to_vec(&work)?)?;
    let out = env.kubectl().arg("apply").arg("-f").arg(&path).output()?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The Deployment's ReadyReplicas as the hub's work shows it.
fn ready_replicas(work: &Value) -> Option<i64> {
    work["status"]["resourceStatus"]["manifests"]
        .as_array()?
        .iter()
        .find(|m| m["resourceMeta"]["name"] == "web")?["statusFeedback"]["values"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == "ReadyReplicas")?["fieldValue"]["integer"]
        .as_i64()
}

/// `status.fence` of the hub's work: (gateway, epoch).
fn fence(work: &Value) -> Option<(String, u32)> {
    let fence = &work["status"]["fence"];
    Some((
        fence["gateway"].as_str()?.to_string(),
        fence["epoch"].as_u64()? as u32,
    ))
}

/// What the kube-controller-manager would write (there is none on the spoke): `ready` of the
/// Deployment's replicas ready.
async fn set_ready(spoke: &Spoke, ready: i32) -> anyhow::Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(spoke.env.client().await?, "default");
    deployments
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"replicas": 3, "readyReplicas": ready, "availableReplicas": ready}})),
        )
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_gateways_late_status_write_is_refused_by_the_store() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let dir = dir.path();
    let env = TestEnv::start().await?;
    env.install_crds(&workspace_root().join("deploy/crds"))
        .await?;
    let kubeconfig = env.kubeconfig_path().to_path_buf();
    let kc = kubeconfig.to_str().context("kubeconfig path")?;
    let mut hub_flags = vec!["--store=kube", "--kubeconfig", kc, "--gateways=external"];
    hub_flags.extend(LEASE_FLAGS);
    let hub = Hub::start(dir, &hub_flags).await?;
    let certs = hub.gateway_cert(dir)?;

    // A holds its writes of the clusters named in fault/hold; its log is JSON with the write log.
    let fault = dir.join("fault");
    std::fs::create_dir_all(&fault)?;
    let fault_dir = fault.to_str().context("fault dir path")?;
    let (metrics_a, metrics_b) = (
        format!("127.0.0.1:{}", free_port()?),
        format!("127.0.0.1:{}", free_port()?),
    );
    let flags = |metrics: &str| {
        let mut flags: Vec<String> = LEASE_FLAGS.iter().map(|f| f.to_string()).collect();
        flags.push(format!("--metrics-addr={metrics}"));
        flags
    };
    let (flags_a, flags_b) = (flags(&metrics_a), flags(&metrics_b));
    let mut flags_a: Vec<&str> = flags_a.iter().map(String::as_str).collect();
    flags_a.push("--log-format=json");
    let flags_b: Vec<&str> = flags_b.iter().map(String::as_str).collect();
    let mut a = GatewayProc::start_with_env(
        dir,
        "gw-a",
        &kubeconfig,
        &certs,
        &flags_a,
        &[
            ("FLOTILLA_GATEWAY_FAULT_DIR", fault_dir),
            (
                "RUST_LOG",
                "info,flotilla_gateway=debug,flotilla::fenced_write=debug",
            ),
        ],
    )?;
    let b = GatewayProc::start(dir, "gw-b", &kubeconfig, &certs, &flags_b)?;
    let logs = |a: &GatewayProc, b: &GatewayProc| {
        format!(
            "--- gw-a ---\n{}\n--- gw-b ---\n{}",
            a.proc.log(),
            b.proc.log()
        )
    };

    // The shards divided; a cluster of one of A's.
    let leases: Api<Lease> = Api::namespaced(env.client().await?, "flotilla-system");
    let (cluster, shard, epoch_a) = wait_for("A holding some shards", WAIT, || async {
        for n in 0..64 {
            let cluster = format!("fence-{n:02}");
            let shard = shard_of(&cluster, SHARDS);
            if let Some((holder, epoch)) = lease_of(&leases, shard).await?
                && holder == "gw-a"
            {
                return Ok(Some((cluster, shard, epoch)));
            }
        }
        Ok(None)
    })
    .await
    .with_context(|| logs(&a, &b))?;

    let spoke = Spoke::start(dir, &hub, &cluster).await?;
    let agent = spoke.start_agent(dir, &hub, &["--feedback-interval=300ms"])?;
    apply_work(&env, dir, &cluster)?;
    // A stored the agent's first status (the Deployment applied, nothing ready yet).
    wait_for("A storing the work's first status", WAIT, || async {
        Ok(hub.work(&cluster, WORK)?.filter(|w| {
            fence(w) == Some(("gw-a".into(), epoch_a)) && w["status"]["conditions"].is_array()
        }))
    })
    .await
    .with_context(|| format!("{}\n--- agent ---\n{}", logs(&a, &b), agent.log()))?;

    // A's next write for the cluster is parked: the spoke's Deployment gets a ready replica.
    std::fs::write(fault.join("hold"), format!("{cluster}\n"))?;
    set_ready(&spoke, 1).await?;
    let object = format!("ManifestWork {cluster}/{WORK}");
    wait_for(
        "A's status write parked at its fault point",
        WAIT,
        || async {
            let held = std::fs::read_to_string(fault.join("held")).unwrap_or_default();
            Ok(held.contains(&object).then_some(()))
        },
    )
    .await
    .with_context(|| logs(&a, &b))?;

    // A stops past its lease; B takes the shard under a newer epoch.
    let a_pid = Pid::from_raw(a.proc.pid() as i32);
    kill(a_pid, Signal::SIGSTOP)?;
    let epoch_b = wait_for("B holding A's shard", WAIT, || async {
        Ok(lease_of(&leases, shard)
            .await?
            .filter(|(holder, epoch)| holder == "gw-b" && *epoch > epoch_a)
            .map(|(_, epoch)| epoch))
    })
    .await;
    let epoch_b = match epoch_b {
        Ok(e) => e,
        Err(e) => {
            let _ = kill(a_pid, Signal::SIGCONT);
            return Err(e.context(logs(&a, &b)));
        }
    };

    // The agent moves to B, and the spoke's newer status is B's to store.
    set_ready(&spoke, 2).await?;
    let stored = wait_for("B storing the newer status", WAIT, || async {
        Ok(hub
            .work(&cluster, WORK)?
            .filter(|w| fence(w) == Some(("gw-b".into(), epoch_b)) && ready_replicas(w) == Some(2)))
    })
    .await;
    let by_b = match stored {
        Ok(w) => w,
        Err(e) => {
            let _ = kill(a_pid, Signal::SIGCONT);
            return Err(e.context(format!("{}\n--- agent ---\n{}", logs(&a, &b), agent.log())));
        }
    };

    // A goes on, and its parked write is released: the store refuses it.
    kill(a_pid, Signal::SIGCONT)?;
    std::fs::write(fault.join("release"), "")?;
    let stale = [("reason", "stale_epoch")];
    let refused = || async {
        let page = scrape(&metrics_a).await?;
        anyhow::Ok(page.value("flotilla_gateway_fenced_writes_total", &stale) >= Some(1.0))
    };
    let now = wait_for("A's write refused, or stored", WAIT, || async {
        let now = hub.work(&cluster, WORK)?.context("the work is gone")?;
        let overwritten = fence(&now) != Some(("gw-b".into(), epoch_b));
        Ok((refused().await? || overwritten).then_some(now))
    })
    .await
    .with_context(|| logs(&a, &b))?;
    assert_eq!(
        fence(&now),
        Some(("gw-b".into(), epoch_b)),
        "A's write landed over B's: {now}"
    );
    assert!(refused().await?, "A counted its write refused");

    // A says so once, naming the shard, both epochs and the object; its write log has it.
    let log = a.proc.log();
    let events: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let refusal = events
        .iter()
        .find(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("fenced write refused by the store"))
        })
        .with_context(|| format!("no refusal in A's log:\n{log}"))?;
    assert_eq!(refusal["level"], "WARN", "{refusal}");
    let fields = &refusal["fields"];
    assert_eq!(fields["object"], object.as_str(), "{refusal}");
    assert_eq!(fields["shard"], shard, "{refusal}");
    assert_eq!(fields["epoch"], epoch_a, "{refusal}");
    assert_eq!(fields["stored_epoch"], epoch_b, "{refusal}");
    assert_eq!(fields["stored_by"], "gw-b", "{refusal}");
    assert_eq!(fields["reason"], "stale_epoch", "{refusal}");
    let written: Vec<&Value> = events
        .iter()
        .filter(|e| e["target"] == "flotilla::fenced_write" && e["fields"]["name"] == WORK)
        .collect();
    let refused = written
        .iter()
        .find(|e| e["fields"]["outcome"] == "refused_stale_epoch")
        .with_context(|| format!("no refused write in A's write log: {written:?}"))?;
    let f = &refused["fields"];
    assert_eq!(
        (&f["kind"], &f["namespace"], &f["cluster"], &f["gateway"]),
        (
            &json!("ManifestWork"),
            &json!(cluster),
            &json!(cluster),
            &json!("gw-a")
        ),
        "{refused}"
    );
    assert_eq!(
        (&f["epoch"], &f["stored_epoch"]),
        (&json!(epoch_a), &json!(epoch_b)),
        "{refused}"
    );
    assert!(
        f["report_sequence"].is_u64() && f["sent_at_unix_ms"].is_u64(),
        "{refused}"
    );
    assert!(
        written
            .iter()
            .any(|e| e["fields"]["outcome"] == "written"
                && e["fields"]["resource_version"].is_string()),
        "A's earlier write is in its write log: {written:?}"
    );

    // The work's status is B's, as B wrote it.
    let now = hub.work(&cluster, WORK)?.context("the work is gone")?;
    assert_eq!(fence(&now), Some(("gw-b".into(), epoch_b)), "{now}");
    assert_eq!(ready_replicas(&now), Some(2), "{now}");
    assert_eq!(now["status"], by_b["status"], "the status is as B wrote it");
    drop(agent);
    a.proc.signal_and_wait(Signal::SIGKILL);
    Ok(())
}
