//! The real kubectl's streaming commands through the hub's proxy front, a gateway session and
//! the agent's tunnel end into a pod of a full spoke, whose kubelet API kwok serves: `logs`,
//! `logs -f` seeing a line written after it started, `exec` with stdin, stderr and an exit
//! code, `attach`, `cp` both ways, `port-forward` carrying an HTTP request; each over WebSocket
//! (kubectl's default) and over SPDY, on both carriers, with the audit line of each.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use flotilla_e2e::proxy::{KUBECTL_TIMEOUT, hub_with_proxy};
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{on_both_carriers, wait_for};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpListener, TcpStream};

const CLUSTER: &str = "store-1";
const POD: &str = "till";
/// Long enough for a loaded 2-core machine to schedule and run a pod.
const WORKLOAD_TIMEOUT: Duration = Duration::from_secs(120);

const RULES: &str = r#"
rules:
  - name: ops-store-1
    groups: [ops]
    clusters: {names: [store-1]}
    access: full
"#;

/// kubectl's two streaming protocols: its default, WebSocket, and SPDY, which kubectl still
/// speaks when told to and which older kubectls and other clients use.
const PROTOCOLS: [(&str, &[(&str, &str)]); 2] = [
    ("websocket", &[]),
    (
        "spdy",
        &[
            ("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false"),
            ("KUBECTL_PORT_FORWARD_WEBSOCKETS", "false"),
        ],
    ),
];

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    /// What the remote command wrote to its stderr: kubectl's stderr less its own notice of a
    /// message it dropped before it had set up that message's stream. kubectl's WebSocket
    /// client starts reading the connection before it creates its stdout and stderr streams,
    /// and says "Unknown stream id N, discarding message" for a message that arrives first
    /// (it did once, over QUIC, with the command's stdout and stderr both whole). A message
    /// that carried output would show as output missing, which the callers check.
    fn remote_stderr(&self) -> String {
        self.stderr
            .lines()
            .filter(|line| {
                !(line.contains("] Unknown stream id ") && line.ends_with(", discarding message"))
            })
            .map(|line| format!("{line}\n"))
            .collect()
    }
}

/// Runs kubectl with `kubeconfig`, `env` and `stdin`, bounded.
async fn kubectl(
    kubeconfig: &Path,
    env: &[(&str, &str)],
    args: &[&str],
    stdin: &[u8],
) -> anyhow::Result<Run> {
    let mut child = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut input = child.stdin.take().expect("piped");
    input.write_all(stdin).await?;
    drop(input);
    let out = tokio::time::timeout(KUBECTL_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| {
            anyhow::anyhow!("kubectl {args:?} did not finish within {KUBECTL_TIMEOUT:?}")
        })??;
    Ok(Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Pod `default/till` on the spoke, Ready, and a Role in `default` for group ops to read pods
/// and their logs, exec, attach and port-forward, created directly on the spoke.
async fn ready_pod_for_ops(spoke: &Spoke) -> anyhow::Result<()> {
    let client = spoke.env.client().await?;
    let pp = PostParams::default();
    Api::<Role>::namespaced(client.clone(), "default")
        .create(&pp, &serde_json::from_value(json!({
            "metadata": {"name": "pod-operator"},
            "rules": [
                {"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods/exec", "pods/attach", "pods/portforward"], "verbs": ["get", "create"]},
            ],
        }))?)
        .await?;
    Api::<RoleBinding>::namespaced(client.clone(), "default")
        .create(&pp, &serde_json::from_value(json!({
            "metadata": {"name": "ops-pod-operator"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-operator"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "ops"}],
        }))?)
        .await?;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": POD},
            "spec": {"containers": [{"name": "till", "image": "registry.example/till:1"}]},
        }))?,
    )
    .await?;
    wait_for(
        &format!("pod default/{POD} Ready"),
        WORKLOAD_TIMEOUT,
        || async {
            let status = serde_json::to_value(pods.get(POD).await?.status)?;
            let ready = status["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            Ok(ready.then_some(()))
        },
    )
    .await
    .map_err(|e| e.context(spoke.env.log_tails()))
}

/// `kubectl logs -f` shows the log so far, then `appended`, written only once the stream has
/// shown `last` (so it can only have come through the open stream).
async fn follow_sees(
    kubeconfig: &Path,
    env: &[(&str, &str)],
    spoke: &Spoke,
    last: &str,
    appended: &str,
) -> anyhow::Result<Vec<String>> {
    let mut follow = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["logs", "-f", POD])
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(follow.stdout.take().expect("piped")).lines();
    let mut seen = Vec::new();
    let followed = tokio::time::timeout(KUBECTL_TIMEOUT, async {
        let mut written = false;
        while let Some(line) = lines.next_line().await? {
            seen.push(line.clone());
            if line == last && !written {
                spoke.env.cluster()?.append_container_log(appended)?;
                written = true;
            }
            if line == appended {
                return anyhow::Ok(());
            }
        }
        anyhow::bail!("kubectl logs -f ended")
    })
    .await;
    follow.kill().await?;
    let stderr = {
        let mut text = String::new();
        if let Some(mut err) = follow.stderr.take() {
            tokio::io::AsyncReadExt::read_to_string(&mut err, &mut text).await?;
        }
        text
    };
    match followed {
        Ok(Ok(())) => Ok(seen),
        Ok(Err(e)) => Err(e.context(format!("lines seen {seen:?}; stderr {stderr}"))),
        Err(_) => anyhow::bail!(
            "kubectl logs -f never showed {appended:?}; saw {seen:?}; stderr {stderr}"
        ),
    }
}

/// `kubectl port-forward pod/till :8080` carries one HTTP request to `server` (kwok connects
/// every forwarded port to the cluster's port-forward target, where `server` listens) and its
/// answer back; returns the request line the server saw.
async fn port_forward_carries(
    kubeconfig: &Path,
    env: &[(&str, &str)],
    server: &TcpListener,
    path: &str,
) -> anyhow::Result<String> {
    let (mut forward, local) = forwarding(kubeconfig, env).await?;

    let exchange = async {
        let mut client = TcpStream::connect(("127.0.0.1", local)).await?;
        client
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: till\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
        let (mut conn, _) = server.accept().await?;
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            anyhow::ensure!(conn.read(&mut byte).await? == 1, "the request ended early");
            head.push(byte[0]);
        }
        conn.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\norders ok",
        )
        .await?;
        conn.shutdown().await?;
        // Read as an HTTP client does, to the end of the body its Content-Length announces:
        // whether kubectl closes the local connection when the pod's side closes is its own
        // business.
        let mut answer = Vec::new();
        let mut chunk = [0u8; 256];
        while !answer.ends_with(b"\r\n\r\norders ok") {
            let n = client.read(&mut chunk).await?;
            anyhow::ensure!(
                n > 0,
                "the answer ended early: {:?}",
                String::from_utf8_lossy(&answer)
            );
            answer.extend_from_slice(&chunk[..n]);
        }
        anyhow::ensure!(
            answer.starts_with(b"HTTP/1.1 200 OK\r\n"),
            "answer {:?}",
            String::from_utf8_lossy(&answer)
        );
        let head = String::from_utf8(head)?;
        Ok(head.lines().next().unwrap_or_default().to_owned())
    };
    let seen = tokio::time::timeout(Duration::from_secs(60), exchange)
        .await
        .map_err(|_| {
            anyhow::anyhow!("the request through port-forward did not complete within 60 s")
        })?;
    forward.kill().await?;
    seen
}

/// `kubectl attach till` shows what the container writes while attached. kwok's attach follows
/// the container log from its end, and nothing says when it has opened it, so a numbered line is
/// written until one arrives (each waited for up to a second); returns the line seen.
async fn attach_sees(
    kubeconfig: &Path,
    env: &[(&str, &str)],
    spoke: &Spoke,
    protocol: &str,
) -> anyhow::Result<String> {
    let mut attach = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["attach", POD])
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(attach.stdout.take().expect("piped")).lines();
    let deadline = tokio::time::Instant::now() + KUBECTL_TIMEOUT;
    let mut n = 0;
    let seen = loop {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "kubectl attach showed none of {n} lines written within {KUBECTL_TIMEOUT:?}"
        );
        n += 1;
        spoke
            .env
            .cluster()?
            .append_container_log(&format!("attached {protocol} {n}"))?;
        match tokio::time::timeout(Duration::from_secs(1), lines.next_line()).await {
            Ok(Ok(Some(line))) => break line,
            Ok(Ok(None)) => anyhow::bail!("kubectl attach ended"),
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => continue,
        }
    };
    attach.kill().await?;
    Ok(seen)
}

on_both_carriers! {
    /// logs, logs -f, exec (stdin, stderr, exit code), attach, cp and port-forward through the hub, over WebSocket and
    /// SPDY, into a pod the spoke's own scheduler placed on a kwok node.
    async fn kubectl_streams_reach_a_pod_through_the_hub() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = hub_with_proxy(dir.path(), RULES, "", &[]).await?;
        let spoke = Spoke::start_full(dir.path(), &hub, CLUSTER).await?;
        let _agent = spoke.start_agent(dir.path(), &hub, &[])?;
        hub.wait_available(CLUSTER).await?;
        ready_pod_for_ops(&spoke).await?;
        let alice = hub.create_user(dir.path(), "alice", &["ops"])?;
        let cluster = spoke.env.cluster()?;
        cluster.append_container_log("till started")?;

        let target = TcpListener::bind(cluster.port_forward_target()).await?;
        for (protocol, env) in PROTOCOLS {
            let logs = kubectl(&alice, env, &["logs", POD], b"").await?;
            assert_eq!(logs.code, Some(0), "{protocol}: kubectl logs: {}", logs.stderr);
            assert!(logs.stdout.starts_with("till started\n"), "{protocol}: {}", logs.stdout);

            let last = logs.stdout.lines().last().expect("a line").to_owned();
            let appended = format!("{protocol}: sale 1");
            let seen = follow_sees(&alice, env, &spoke, &last, &appended).await?;
            assert_eq!(seen.first().map(String::as_str), Some("till started"), "{protocol}");

            let echoed = kubectl(&alice, env, &["exec", "-i", POD, "--", "cat"], b"receipt 1\nreceipt 2\n").await?;
            assert_eq!(echoed.code, Some(0), "{protocol}: kubectl exec -i cat: {}", echoed.stderr);
            assert_eq!(echoed.stdout, "receipt 1\nreceipt 2\n", "{protocol}: stdin echoed back");

            let both = kubectl(&alice, env, &["exec", POD, "--", "sh", "-c", "echo out; echo err >&2"], b"").await?;
            assert_eq!(both.code, Some(0), "{protocol}: {}", both.stderr);
            assert_eq!(both.stdout, "out\n", "{protocol}");
            assert_eq!(both.remote_stderr(), "err\n", "{protocol}: stderr on its own channel: {}", both.stderr);

            let failed = kubectl(&alice, env, &["exec", POD, "--", "sh", "-c", "exit 3"], b"").await?;
            assert_eq!(failed.code, Some(3), "{protocol}: the command's exit code: {}", failed.stderr);

            let attached = attach_sees(&alice, env, &spoke, protocol).await?;
            assert!(attached.starts_with(&format!("attached {protocol} ")), "{protocol}: {attached}");

            // cp is tar through exec: into the pod (the exec directory), and back out.
            let name = format!("receipt-{protocol}.txt");
            let upload = dir.path().join(&name);
            std::fs::write(&upload, format!("receipt via {protocol}\n"))?;
            let into = kubectl(&alice, env, &["cp", &upload.display().to_string(), &format!("{POD}:{name}")], b"").await?;
            assert_eq!(into.code, Some(0), "{protocol}: kubectl cp into the pod: {}", into.stderr);
            assert_eq!(std::fs::read_to_string(cluster.exec_dir().join(&name))?, format!("receipt via {protocol}\n"));
            let back = dir.path().join(format!("back-{name}"));
            let out = kubectl(&alice, env, &["cp", &format!("{POD}:{name}"), &back.display().to_string()], b"").await?;
            assert_eq!(out.code, Some(0), "{protocol}: kubectl cp out of the pod: {}", out.stderr);
            assert_eq!(std::fs::read_to_string(&back)?, format!("receipt via {protocol}\n"));

            let path = format!("/orders?via={protocol}");
            let request = port_forward_carries(&alice, env, &target, &path).await?;
            assert_eq!(request, format!("GET {path} HTTP/1.1"), "{protocol}");
        }

        // The audit: one line per stream, written when it ended, naming the pod's subresource.
        let exec_path = format!("/api/v1/namespaces/default/pods/{POD}/exec");
        let log_path = format!("/api/v1/namespaces/default/pods/{POD}/log");
        // Each line is written when its stream has ended, which for the killed kubectls (logs -f,
        // attach, port-forward) is after the test went on: wait for all of them.
        let count = |lines: &[Value], subresource: &str| {
            let path = format!("/api/v1/namespaces/default/pods/{POD}/{subresource}");
            lines.iter().filter(|l| l["path"] == path.as_str()).count()
        };
        let lines = wait_for("audit lines of every stream", Duration::from_secs(30), || async {
            let lines = hub.audit_lines()?;
            let all = count(&lines, "exec") >= 12
                && count(&lines, "log") >= 4
                && count(&lines, "attach") >= 2
                && count(&lines, "portforward") >= 2;
            Ok(all.then_some(lines))
        })
        .await?;
        let execs: Vec<&Value> = lines.iter().filter(|l| l["path"] == exec_path.as_str()).collect();
        // Over each protocol: 3 execs, and the 3 that kubectl cp ran for one copy in and one out.
        assert_eq!(execs.len(), 12, "{execs:?}");
        for line in &execs {
            assert_eq!(line["user"], "alice", "{line}");
            assert_eq!(line["cluster"], CLUSTER, "{line}");
            assert_eq!(line["status"], 101, "an upgraded stream: {line}");
            assert!(line.get("refused").is_none(), "{line}");
        }
        // WebSocket upgrades a GET (Kubernetes' verb get), SPDY a POST (create): both were used.
        let by = |method: &str, verb: &str| {
            execs.iter().filter(|l| l["method"] == method && l["verb"] == verb).count()
        };
        assert_eq!((by("GET", "get"), by("POST", "create")), (6, 6), "{execs:?}");
        let forwards: Vec<&Value> = lines.iter().filter(|l| l["path"] == format!("/api/v1/namespaces/default/pods/{POD}/portforward")).collect();
        assert_eq!(forwards.len(), 2, "a port-forward over each protocol: {forwards:?}");
        assert!(forwards.iter().all(|l| l["status"] == 101 && l["user"] == "alice"), "{forwards:?}");
        let attaches: Vec<&Value> = lines.iter().filter(|l| l["path"] == format!("/api/v1/namespaces/default/pods/{POD}/attach")).collect();
        assert_eq!(attaches.len(), 2, "an attach over each protocol: {attaches:?}");
        assert!(attaches.iter().all(|l| l["status"] == 101 && l["user"] == "alice"), "{attaches:?}");
        let logs: Vec<&Value> = lines.iter().filter(|l| l["path"] == log_path.as_str()).collect();
        assert_eq!(logs.len(), 4, "logs and logs -f over each protocol: {logs:?}");
        for line in &logs {
            assert_eq!((&line["user"], &line["verb"], &line["status"]), (&json!("alice"), &json!("get"), &json!(200)), "{line}");
        }
        Ok(())
    }
}

/// MiB each port-forward download carries: `FLOTILLA_STREAM_MIB`, 8 by default (the figures in
/// docs/performance.md were taken with more).
fn stream_mib() -> usize {
    std::env::var("FLOTILLA_STREAM_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}
/// Lines each `logs -f` is timed on.
const FOLLOW_MARKS: usize = 10;
/// Downloads through each path's port-forward.
const DOWNLOADS: usize = 3;

/// The byte at `offset` of a download: a pattern no shifted or dropped chunk can match.
fn download_byte(offset: usize) -> u8 {
    (offset % 251) as u8
}

/// `kubectl logs -f POD` running, its lines sent with the moment each was read.
fn follow_lines(
    kubeconfig: &Path,
) -> anyhow::Result<(
    tokio::process::Child,
    tokio::sync::mpsc::Receiver<(String, tokio::time::Instant)>,
)> {
    let mut follow = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["logs", "-f", POD])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(follow.stdout.take().expect("piped")).lines();
    let (sent, received) = tokio::sync::mpsc::channel(1024);
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            if sent
                .send((line, tokio::time::Instant::now()))
                .await
                .is_err()
            {
                break;
            }
        }
    });
    Ok((follow, received))
}

/// Reads `follower` until `line`; when it arrived.
async fn arrival(
    follower: &mut tokio::sync::mpsc::Receiver<(String, tokio::time::Instant)>,
    line: &str,
    path: &str,
) -> anyhow::Result<tokio::time::Instant> {
    tokio::time::timeout(KUBECTL_TIMEOUT, async {
        while let Some((seen, at)) = follower.recv().await {
            if seen == line {
                return Ok(at);
            }
        }
        anyhow::bail!("kubectl logs -f {path} ended before {line:?}")
    })
    .await
    .map_err(|_| anyhow::anyhow!("kubectl logs -f {path} never showed {line:?}"))?
}

/// `kubectl port-forward pod/POD :8080` running with `env`; the local port it listens on.
async fn forwarding(
    kubeconfig: &Path,
    env: &[(&str, &str)],
) -> anyhow::Result<(tokio::process::Child, u16)> {
    let mut forward = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["port-forward", &format!("pod/{POD}"), ":8080"])
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(forward.stdout.take().expect("piped")).lines();
    let port = tokio::time::timeout(KUBECTL_TIMEOUT, async {
        while let Some(line) = lines.next_line().await? {
            if let Some(rest) = line.strip_prefix("Forwarding from 127.0.0.1:") {
                return Ok(rest.split(' ').next().unwrap_or_default().parse::<u16>()?);
            }
        }
        anyhow::bail!("kubectl port-forward ended without listening")
    })
    .await
    .map_err(|_| anyhow::anyhow!("kubectl port-forward did not listen in time"))??;
    // Its later lines ("Handling connection for 8080") must not fill the pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((forward, port))
}

/// One download of `bytes` through the port-forward at `local`: the pod's side (`server`, where
/// kwok connects every forwarded port) sends the pattern and closes; every byte is checked.
/// How long it took from the request to the last byte.
async fn download(server: &TcpListener, local: u16, bytes: usize) -> anyhow::Result<Duration> {
    let started = tokio::time::Instant::now();
    let mut client = TcpStream::connect(("127.0.0.1", local)).await?;
    client.write_all(b"send\n").await?;
    let (mut conn, _) = server.accept().await?;
    let mut request = [0u8; 5];
    conn.read_exact(&mut request).await?;
    anyhow::ensure!(&request == b"send\n", "request {request:?}");
    let sender = tokio::spawn(async move {
        let chunk: Vec<u8> = (0..251 * 256).map(download_byte).collect();
        let mut sent = 0;
        while sent < bytes {
            let n = (bytes - sent).min(chunk.len());
            conn.write_all(&chunk[..n]).await?;
            sent += n;
        }
        conn.shutdown().await?;
        anyhow::Ok(())
    });
    let mut received = 0;
    let mut buf = vec![0u8; 256 * 1024];
    while received < bytes {
        let n = client.read(&mut buf).await?;
        anyhow::ensure!(n > 0, "the download ended at {received} of {bytes} bytes");
        for (i, b) in buf[..n].iter().enumerate() {
            anyhow::ensure!(
                *b == download_byte(received + i),
                "byte {} differs",
                received + i
            );
        }
        received += n;
    }
    let took = started.elapsed();
    sender.await??;
    Ok(took)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

on_both_carriers! {
    /// `kubectl logs -f` and `kubectl port-forward` through the hub beside the same commands
    /// sent straight to the spoke's apiserver, interleaved so both see the same machine: every
    /// line written while both follow arrives on both paths, and every byte of each download
    /// through either port-forward arrives intact. How long each took is printed (docs/
    /// performance.md quotes it), never asserted.
    async fn logs_follow_and_port_forward_carry_what_the_direct_path_does() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = hub_with_proxy(dir.path(), RULES, "", &[]).await?;
        let spoke = Spoke::start_full(dir.path(), &hub, CLUSTER).await?;
        let _agent = spoke.start_agent(dir.path(), &hub, &[])?;
        hub.wait_available(CLUSTER).await?;
        ready_pod_for_ops(&spoke).await?;
        let alice = hub.create_user(dir.path(), "alice", &["ops"])?;
        let direct = spoke.env.kubeconfig_path().to_path_buf();
        let cluster = spoke.env.cluster()?;
        cluster.append_container_log("till started")?;

        // logs -f: both follow at once; each marked line is written once, read by both.
        let (_through_hub, mut hub_lines) = follow_lines(&alice)?;
        let (_straight, mut direct_lines) = follow_lines(&direct)?;
        arrival(&mut hub_lines, "till started", "through the hub").await?;
        arrival(&mut direct_lines, "till started", "direct").await?;
        let (mut via_hub, mut via_direct) = (Vec::new(), Vec::new());
        for mark in 0..FOLLOW_MARKS {
            let line = format!("mark {mark}");
            let written = tokio::time::Instant::now();
            cluster.append_container_log(&line)?;
            let hub_at = arrival(&mut hub_lines, &line, "through the hub").await?;
            let direct_at = arrival(&mut direct_lines, &line, "direct").await?;
            via_hub.push((hub_at - written).as_secs_f64() * 1e3);
            via_direct.push((direct_at - written).as_secs_f64() * 1e3);
        }

        // port-forward: downloads alternate between the two paths.
        let target = TcpListener::bind(cluster.port_forward_target()).await?;
        let (_hub_forward, hub_port) = forwarding(&alice, &[]).await?;
        let (_direct_forward, direct_port) = forwarding(&direct, &[]).await?;
        let bytes = stream_mib() * 1024 * 1024;
        let (mut hub_rate, mut direct_rate) = (Vec::new(), Vec::new());
        for _ in 0..DOWNLOADS {
            let mb = bytes as f64 / 1e6;
            hub_rate.push(mb / download(&target, hub_port, bytes).await?.as_secs_f64());
            direct_rate.push(mb / download(&target, direct_port, bytes).await?.as_secs_f64());
        }
        eprintln!(
            "kubectl streams ({:?}): logs -f latency median direct {:.1} ms, through the hub {:.1} ms \
             ({FOLLOW_MARKS} lines); port-forward download of {} MiB median direct {:.1} MB/s, \
             through the hub {:.1} MB/s ({DOWNLOADS} each)",
            flotilla_e2e::current_carrier(),
            median(&mut via_direct),
            median(&mut via_hub),
            stream_mib(),
            median(&mut direct_rate),
            median(&mut hub_rate),
        );
        Ok(())
    }
}
