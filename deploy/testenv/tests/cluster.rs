//! The full test cluster against itself: Kubernetes' own controllers, scheduler and kwok's
//! kubelets make workloads run, with nothing written by the test but the workloads.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use flotilla_testenv::{TestCluster, wait_for};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

/// Long enough for a loaded 2-core machine; each wait ends as soon as its condition holds.
const WORKLOAD_TIMEOUT: Duration = Duration::from_secs(90);

fn condition_true(conditions: Option<&Vec<serde_json::Value>>, kind: &str) -> bool {
    conditions
        .into_iter()
        .flatten()
        .any(|c| c["type"] == kind && c["status"] == "True")
}

/// What kubectl shows of the workloads, for a failure's message.
fn state(cluster: &TestCluster) -> String {
    match cluster
        .kubectl()
        .args([
            "get",
            "deployments,replicasets,pods,events",
            "-A",
            "-o",
            "wide",
        ])
        .output()
    {
        Ok(out) => format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(err) => format!("(kubectl: {err})"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_become_available_jobs_complete_and_namespaces_go() -> anyhow::Result<()> {
    let cluster = TestCluster::start().await?;
    let client = cluster.client().await?;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "default");
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {
                    "replicas": 2,
                    "selector": {"matchLabels": {"app": "web"}},
                    "template": {
                        "metadata": {"labels": {"app": "web"}},
                        "spec": {"containers": [{"name": "nginx", "image": "nginx:1.25"}]},
                    },
                },
            }))?,
        )
        .await?;
    let status = wait_for(
        "deployment default/web Available with 2 ready replicas",
        WORKLOAD_TIMEOUT,
        || async {
            let status = serde_json::to_value(deployments.get("web").await?.status)?;
            let available = condition_true(status["conditions"].as_array(), "Available");
            Ok((available && status["readyReplicas"] == 2).then_some(status))
        },
    )
    .await
    .map_err(|e| e.context(format!("{}\n{}", state(&cluster), cluster.log_tails())))?;
    assert_eq!(status["availableReplicas"], 2, "{status}");

    // The ReplicaSet's pods, each bound by the scheduler to one of kwok's nodes and Running.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let web = pods.list(&ListParams::default().labels("app=web")).await?;
    assert_eq!(web.items.len(), 2, "pods of web");
    for pod in &web.items {
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        assert!(
            node.as_ref().is_some_and(|n| cluster.nodes().contains(n)),
            "pod {:?} is on {node:?}",
            pod.metadata.name
        );
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        assert_eq!(phase, Some("Running"), "pod {:?}", pod.metadata.name);
        let owner = &pod.metadata.owner_references.as_ref().expect("owned")[0];
        assert_eq!(
            owner.kind, "ReplicaSet",
            "made by the ReplicaSet controller"
        );
    }

    let jobs: Api<Job> = Api::namespaced(client.clone(), "default");
    jobs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "migrate"},
            "spec": {"template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "migrate", "image": "busybox"}],
            }}},
        }))?,
    )
    .await?;
    let status = wait_for("job default/migrate Complete", WORKLOAD_TIMEOUT, || async {
        let status = serde_json::to_value(jobs.get("migrate").await?.status)?;
        Ok(condition_true(status["conditions"].as_array(), "Complete").then_some(status))
    })
    .await
    .map_err(|e| e.context(cluster.log_tails()))?;
    assert_eq!(status["succeeded"], 1, "{status}");

    // A deleted namespace is emptied and finalized by the namespace controller.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "doomed"}}))?,
        )
        .await?;
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), "doomed");
    config_maps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "settings"}}))?,
        )
        .await?;
    namespaces
        .delete("doomed", &DeleteParams::default())
        .await?;
    wait_for("namespace doomed gone", WORKLOAD_TIMEOUT, || async {
        Ok(namespaces.get_opt("doomed").await?.is_none().then_some(()))
    })
    .await
    .map_err(|e| e.context(cluster.log_tails()))?;

    let pids = cluster.pids();
    let workdir = cluster.workdir().to_owned();
    drop(cluster);
    for (name, pid) in pids {
        // Drop reaps every child, so its /proc entry is gone (zombies keep theirs).
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "{name} ({pid}) still exists after drop"
        );
    }
    assert!(!workdir.exists(), "{} not removed", workdir.display());
    Ok(())
}

/// Creates pod `default/{name}` and waits until kwok reports it Ready.
async fn ready_pod(cluster: &TestCluster, name: &str) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]},
        }))?,
    )
    .await?;
    wait_for(
        &format!("pod default/{name} Ready"),
        WORKLOAD_TIMEOUT,
        || async {
            let status = serde_json::to_value(pods.get(name).await?.status)?;
            Ok(condition_true(status["conditions"].as_array(), "Ready").then_some(()))
        },
    )
    .await
    .map_err(|e| e.context(format!("{}\n{}", state(cluster), cluster.log_tails())))
}

/// Runs kubectl with `stdin`, returning its exit code, stdout and stderr; bounded.
async fn kubectl(
    cluster: &TestCluster,
    args: &[&str],
    stdin: &[u8],
) -> anyhow::Result<(Option<i32>, String, String)> {
    let mut child = tokio::process::Command::from(cluster.kubectl())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut input = child.stdin.take().expect("piped");
    input.write_all(stdin).await?;
    drop(input);
    let out = tokio::time::timeout(WORKLOAD_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| {
            anyhow::anyhow!("kubectl {args:?} did not finish in {WORKLOAD_TIMEOUT:?}")
        })??;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_logs_and_exec_reach_kwoks_kubelet_through_the_apiserver() -> anyhow::Result<()> {
    let cluster = TestCluster::start_with_nodes(1).await?;
    ready_pod(&cluster, "shell").await?;
    cluster.append_container_log("listening on :8080")?;
    cluster.append_container_log("served GET /healthz")?;

    let (code, out, err) = kubectl(&cluster, &["logs", "shell"], b"").await?;
    assert_eq!(code, Some(0), "kubectl logs: {err}");
    assert_eq!(out, "listening on :8080\nserved GET /healthz\n");

    // `logs -f` keeps the stream open and shows a line written after it started.
    let mut follow = tokio::process::Command::from(cluster.kubectl())
        .args(["logs", "-f", "shell"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(follow.stdout.take().expect("piped")).lines();
    let mut seen = Vec::new();
    let followed = tokio::time::timeout(WORKLOAD_TIMEOUT, async {
        let mut appended = false;
        while let Some(line) = lines.next_line().await? {
            seen.push(line.clone());
            // The earlier lines arrived, so the stream is open: only now write the new one.
            if line == "served GET /healthz" && !appended {
                cluster.append_container_log("served GET /orders")?;
                appended = true;
            }
            if line == "served GET /orders" {
                return anyhow::Ok(());
            }
        }
        anyhow::bail!("kubectl logs -f ended")
    })
    .await;
    follow.kill().await?;
    match followed {
        Ok(result) => result.map_err(|e| e.context(format!("lines seen: {seen:?}")))?,
        Err(_) => anyhow::bail!("kubectl logs -f never showed the appended line; saw {seen:?}"),
    }
    assert_eq!(
        seen,
        [
            "listening on :8080",
            "served GET /healthz",
            "served GET /orders"
        ]
    );

    // exec runs a real process of this machine in the cluster's exec directory.
    let (code, out, err) = kubectl(&cluster, &["exec", "shell", "--", "pwd"], b"").await?;
    assert_eq!(code, Some(0), "kubectl exec pwd: {err}");
    assert_eq!(Path::new(out.trim_end()), cluster.exec_dir());

    let (code, out, err) = kubectl(
        &cluster,
        &["exec", "-i", "shell", "--", "cat"],
        b"order 1\norder 2\n",
    )
    .await?;
    assert_eq!(code, Some(0), "kubectl exec -i cat: {err}");
    assert_eq!(out, "order 1\norder 2\n", "stdin echoed");

    let (code, _, err) = kubectl(
        &cluster,
        &["exec", "shell", "--", "sh", "-c", "echo oops >&2; exit 3"],
        b"",
    )
    .await?;
    assert_eq!(code, Some(3), "kubectl exec exit 3: {err}");
    Ok(())
}
