//! Upgraded streams through the hub's proxy front and the agent's tunnel end (real processes,
//! real TLS, both carriers). There is no kubelet here: the agent's spoke kubeconfig points at
//! a small upgrade endpoint in the test that answers `101 Switching Protocols` to any upgrade
//! and echoes every byte, which is the path kubectl exec, attach and port-forward take (the
//! apiserver upgrades, then relays to the kubelet). WebSocket (kubectl 1.31+) and SPDY both
//! carry bytes both ways intact, and a reader that stops reading one stream delays neither a
//! second stream's requests nor the session's heartbeats.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use flotilla_e2e::on_both_carriers;
use flotilla_e2e::proxy::hub_with_proxy;
use flotilla_e2e::{Hub, Proc, bin, wait_for};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

const CLUSTER: &str = "echo-1";
const RULES: &str = r#"
rules:
  - name: ops
    groups: [ops]
    clusters: {names: [echo-1, store-9]}
    access: full
"#;

/// The upgrade endpoint: records each request head, upgrades any upgrade request and echoes,
/// answers anything else with a small JSON body.
struct UpgradeEcho {
    address: std::net::SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl UpgradeEcho {
    async fn start() -> anyhow::Result<UpgradeEcho> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let heads = Arc::new(Mutex::new(Vec::new()));
        let recorded = heads.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let recorded = recorded.clone();
                tokio::spawn(async move {
                    let _ = serve_echo(conn, recorded).await;
                });
            }
        });
        Ok(UpgradeEcho {
            address,
            heads,
            _task: task,
        })
    }

    fn kubeconfig(&self, dir: &Path) -> anyhow::Result<std::path::PathBuf> {
        let path = dir.join("echo.kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: echo\n  cluster:\n    server: http://{}\nusers:\n- name: agent\n  user: {{}}\ncontexts:\n- name: echo\n  context: {{cluster: echo, user: agent}}\ncurrent-context: echo\n",
                self.address
            ),
        )?;
        Ok(path)
    }
}

async fn serve_echo(mut conn: TcpStream, heads: Arc<Mutex<Vec<String>>>) -> anyhow::Result<()> {
    loop {
        let head = read_head(&mut conn).await?;
        heads.lock().await.push(head.clone());
        let upgrade = head
            .lines()
            .find_map(|l| {
                l.strip_prefix("upgrade: ")
                    .or_else(|| l.strip_prefix("Upgrade: "))
            })
            .map(str::to_string);
        match upgrade {
            Some(protocol) => {
                conn.write_all(
                    format!("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\r\n")
                        .as_bytes(),
                )
                .await?;
                let (mut r, mut w) = conn.split();
                tokio::io::copy(&mut r, &mut w).await?;
                w.shutdown().await?;
                return Ok(());
            }
            None => {
                let body = r#"{"major":"1","minor":"33","gitVersion":"v1.33.0-echo"}"#;
                conn.write_all(
                    format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len())
                        .as_bytes(),
                )
                .await?;
            }
        }
    }
}

/// Reads an HTTP/1.1 head (to the blank line), byte by byte: nothing after it is consumed.
async fn read_head<S: AsyncRead + Unpin>(conn: &mut S) -> anyhow::Result<String> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let byte = conn
            .read_u8()
            .await
            .context("connection closed before the head ended")?;
        head.push(byte);
        anyhow::ensure!(head.len() < 64 * 1024, "head too long");
    }
    Ok(String::from_utf8(head)?)
}

/// A TLS connection to the proxy front as kubectl user `user` (credentials from `flotilla user
/// create`).
async fn connect_as(
    hub: &Hub,
    user: &str,
) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let users = hub.data_dir.join("operator/users").join(user);
    let read = |f: &str| std::fs::read(users.join(f)).with_context(|| format!("{user}'s {f}"));
    let tls = flotilla_transport::tls::client_config(
        &read("ca.crt")?,
        &read("tls.crt")?,
        &read("tls.key")?,
        &[b"http/1.1"],
    )?;
    let url = hub.proxy_url()?;
    let address = url.trim_start_matches("https://");
    let tcp = TcpStream::connect(address).await?;
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1")?;
    Ok(tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await?)
}

/// Sends an upgrade request for an exec on `protocol` and returns the stream once it is
/// upgraded. The request carries credentials and impersonation of its own, which the hub
/// must drop.
async fn upgrade<S: AsyncRead + AsyncWrite + Unpin>(
    mut conn: S,
    protocol: &str,
) -> anyhow::Result<S> {
    conn.write_all(
        format!(
            "GET /clusters/{CLUSTER}/api/v1/namespaces/default/pods/web/exec?command=cat&stdin=true HTTP/1.1\r\n\
             Host: proxy\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
             X-Stream-Protocol-Version: v4.channel.k8s.io\r\n\
             Authorization: Bearer smuggled-token-0123456789\r\nImpersonate-User: system:admin\r\n\r\n"
        )
        .as_bytes(),
    )
    .await?;
    let head = read_head(&mut conn).await?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 101"), "not upgraded: {head}");
    anyhow::ensure!(
        head.to_ascii_lowercase()
            .contains(&format!("upgrade: {}", protocol.to_ascii_lowercase())),
        "{head}"
    );
    Ok(conn)
}

/// Where `back` departs from `sent`, for a failure message.
fn difference(back: &[u8], sent: &[u8]) -> String {
    let first = back.iter().zip(sent).position(|(a, b)| a != b);
    format!(
        "{} bytes back of {} sent, first differing byte at {first:?}",
        back.len(),
        sent.len()
    )
}

/// Bytes that differ from position to position, so a lost, doubled or reordered chunk shows.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + seed as usize) % 251) as u8)
        .collect()
}

/// Sends `data` on an upgraded stream and reads the echo back, concurrently.
async fn round_trip<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    conn: S,
    data: Vec<u8>,
) -> anyhow::Result<Vec<u8>> {
    let (mut r, mut w) = tokio::io::split(conn);
    let writer = tokio::spawn(async move {
        w.write_all(&data).await?;
        w.shutdown().await?;
        anyhow::Ok(())
    });
    let mut back = Vec::new();
    r.read_to_end(&mut back).await?;
    writer.await??;
    Ok(back)
}

async fn start(dir: &Path) -> anyhow::Result<(Hub, UpgradeEcho, Proc)> {
    start_with(dir, &[]).await
}

/// [`start`] with more hub flags.
async fn start_with(dir: &Path, hub_flags: &[&str]) -> anyhow::Result<(Hub, UpgradeEcho, Proc)> {
    let hub = hub_with_proxy(dir, RULES, "", hub_flags).await?;
    let echo = UpgradeEcho::start().await?;
    let certs = dir.join("echo-certs");
    hub.dev_cert(CLUSTER, &certs)?;
    let mut cmd = std::process::Command::new(bin("flotilla-agent"));
    cmd.arg("run")
        .args(["--hub", &hub.agents_addr, "--server-name", "localhost"])
        .args(["--cluster-name", CLUSTER])
        .arg("--cert-dir")
        .arg(&certs)
        .arg("--data-dir")
        .arg(dir.join("echo-agent-data"))
        .arg("--kubeconfig")
        .arg(echo.kubeconfig(dir)?)
        .args([
            "--initial-jitter=0s",
            "--max-backoff=1s",
            "--kubernetes-version=v1.33.0",
        ])
        .arg(format!("--transport={}", hub.carrier))
        .env("RUST_LOG", "info,flotilla_agent=debug");
    let agent = Proc::spawn("flotilla-agent", cmd, dir.join("agent-echo.log"))?;
    wait_for("echo-1 Available", Duration::from_secs(60), || async {
        Ok((hub
            .cluster_condition(CLUSTER, "ManagedClusterConditionAvailable")?
            .as_deref()
            == Some("True"))
        .then_some(()))
    })
    .await?;
    let made = hub.cli(&[
        "user",
        "create",
        "alice",
        "--groups",
        "ops",
        "-o",
        dir.join("alice.kubeconfig").to_str().unwrap(),
    ])?;
    anyhow::ensure!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    Ok((hub, echo, agent))
}

on_both_carriers! {
    /// WebSocket and SPDY upgrades carry a megabyte each way intact, as the hub user.
    async fn upgraded_streams_relay_bytes_both_ways() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let (hub, echo, _agent) = start(dir.path()).await?;
        for (i, protocol) in ["websocket", "SPDY/3.1"].into_iter().enumerate() {
            let conn = upgrade(connect_as(&hub, "alice").await?, protocol).await?;
            let data = pattern(1 << 20, i as u8);
            let back = round_trip(conn, data.clone()).await?;
            assert_eq!(back.len(), data.len(), "{protocol}: bytes lost");
            assert!(back == data, "{protocol}: bytes changed on the way");
        }
        // The endpoint saw the hub user, never what the user smuggled in.
        let heads = echo.heads.lock().await.clone();
        let exec: Vec<&String> = heads.iter().filter(|h| h.contains("/exec?")).collect();
        assert_eq!(exec.len(), 2, "{heads:?}");
        for head in exec {
            let lower = head.to_ascii_lowercase();
            assert!(lower.starts_with("get /api/v1/namespaces/default/pods/web/exec?command=cat&stdin=true http/1.1"), "{head}");
            assert!(lower.contains("impersonate-user: alice\r\n"), "{head}");
            assert!(lower.contains("impersonate-group: ops\r\n"), "{head}");
            assert!(!lower.contains("system:admin") && !lower.contains("smuggled"), "{head}");
            assert!(!lower.contains("authorization"), "{head}");
        }
        // Each upgraded stream's line is written when its relay closes.
        let upgraded = wait_for("the upgraded streams' audit lines", Duration::from_secs(10), || async {
            let lines: Vec<_> = hub.audit_lines()?.into_iter().filter(|l| l["status"] == 101).collect();
            Ok((lines.len() == 2).then_some(lines))
        })
        .await?;
        for line in &upgraded {
            assert_eq!(line["bytesIn"], 1 << 20);
            assert_eq!(line["bytesOut"], 1 << 20);
        }
        Ok(())
    }
}

on_both_carriers! {
    /// A user who stops reading one upgraded stream holds back that stream only: requests on
    /// other tunnels go through and the session keeps its heartbeats (it never restarts).
    async fn a_slow_reader_stalls_only_its_own_tunnel() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let (hub, _echo, agent) = start(dir.path()).await?;
        // 64 MiB: far beyond what every buffer on the way holds, so the writer must stall.
        const TOTAL: usize = 64 << 20;
        let stalled = upgrade(connect_as(&hub, "alice").await?, "websocket").await?;
        let (mut stalled_read, mut stalled_write) = tokio::io::split(stalled);
        let written = Arc::new(AtomicU64::new(0));
        let data = pattern(TOTAL, 7);
        let writer = {
            let (written, data) = (written.clone(), data.clone());
            tokio::spawn(async move {
                for chunk in data.chunks(64 * 1024) {
                    stalled_write.write_all(chunk).await?;
                    written.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
                stalled_write.shutdown().await?;
                anyhow::Ok(())
            })
        };
        wait_for("bytes flowing on the stalled stream", Duration::from_secs(30), || async {
            Ok((written.load(Ordering::Relaxed) >= 1 << 20).then_some(()))
        })
        .await?;
        // Meanwhile: 20 requests on other tunnels, each echoed in full.
        for i in 0..20u8 {
            let conn = upgrade(connect_as(&hub, "alice").await?, "SPDY/3.1").await?;
            let data = pattern(16 * 1024, i);
            let back = round_trip(conn, data.clone()).await?;
            assert!(back == data, "request {i}: {}", difference(&back, &data));
        }
        assert!(
            (written.load(Ordering::Relaxed) as usize) < TOTAL,
            "the unread stream never pushed back; the test proves nothing"
        );
        // One session all along: no heartbeat was missed.
        assert_eq!(agent.log().matches("session established").count(), 1, "{}", agent.log());
        assert_eq!(
            hub.cluster_condition(CLUSTER, "ManagedClusterConditionAvailable")?.as_deref(),
            Some("True")
        );
        // The reader comes back: every byte arrives, in order.
        let mut back = Vec::with_capacity(TOTAL);
        tokio::time::timeout(Duration::from_secs(120), stalled_read.read_to_end(&mut back))
            .await
            .context("the stalled stream did not finish once read")??;
        writer.await??;
        assert_eq!(back.len(), TOTAL);
        assert!(back == data, "bytes changed on the stalled stream");
        Ok(())
    }
}

/// Sends a plain GET of `path` (cluster-relative) with `extra` header lines and returns the
/// response head and body.
async fn plain_get(hub: &Hub, cluster: &str, path: &str, extra: &str) -> anyhow::Result<String> {
    let mut conn = connect_as(hub, "alice").await?;
    conn.write_all(
        format!("GET /clusters/{cluster}{path} HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n{extra}\r\n")
            .as_bytes(),
    )
    .await?;
    let mut response = Vec::new();
    // The hub may close without close_notify after an error; what arrived is the answer.
    let _ = conn.read_to_end(&mut response).await;
    Ok(String::from_utf8_lossy(&response).to_string())
}

on_both_carriers! {
    /// The hub's own answers: 503 naming a cluster without a session and since when, 429 with
    /// Retry-After beyond the per-cluster limit, 431 for an oversized head, and an idle
    /// upgraded stream closed after --proxy-idle-timeout.
    async fn the_hub_bounds_tunnels_and_says_what_is_away() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let (hub, _echo, mut agent) = start_with(
            dir.path(),
            &["--proxy-max-per-cluster=2", "--proxy-idle-timeout=2s", "--proxy-max-header-bytes=16384"],
        )
        .await?;

        // A cluster that never had a session here.
        let never = plain_get(&hub, "store-9", "/version", "").await?;
        assert!(never.starts_with("HTTP/1.1 503"), "{never}");
        assert!(never.to_ascii_lowercase().contains("retry-after: 5"), "{never}");
        assert!(never.contains("cluster store-9 has no session (no session since the gateway started at"), "{never}");

        // Two upgraded streams held open fill echo-1's slots: the third request gets 429.
        let first = upgrade(connect_as(&hub, "alice").await?, "websocket").await?;
        let second = upgrade(connect_as(&hub, "alice").await?, "websocket").await?;
        let over = plain_get(&hub, CLUSTER, "/version", "").await?;
        assert!(over.starts_with("HTTP/1.1 429"), "{over}");
        assert!(over.to_ascii_lowercase().contains("retry-after: 1"), "{over}");
        assert!(over.contains("cluster echo-1 has 2 requests in flight through the hub already (--proxy-max-per-cluster)"), "{over}");

        // Left idle, both are closed after the idle timeout; the slots come back.
        for mut idle in [first, second] {
            let mut rest = Vec::new();
            // Closed: an end of stream, or a reset without TLS close_notify.
            let _closed = tokio::time::timeout(Duration::from_secs(30), idle.read_to_end(&mut rest))
                .await
                .context("an idle upgraded stream stayed open")?;
        }
        wait_for("echo-1's slots back", Duration::from_secs(30), || async {
            let again = plain_get(&hub, CLUSTER, "/version", "").await?;
            Ok(again.starts_with("HTTP/1.1 200").then_some(()))
        })
        .await?;

        // An oversized head never reaches the agent.
        let big = format!("X-Padding: {}\r\n", "a".repeat(32 * 1024));
        let refused = plain_get(&hub, CLUSTER, "/version", &big).await?;
        assert!(refused.starts_with("HTTP/1.1 431"), "{refused}");

        // The agent goes away: the cluster is named with since when.
        agent.signal_and_wait(nix::sys::signal::Signal::SIGKILL);
        let away = wait_for("echo-1 without a session", Duration::from_secs(30), || async {
            let r = plain_get(&hub, CLUSTER, "/version", "").await?;
            Ok(r.starts_with("HTTP/1.1 503").then_some(r))
        })
        .await?;
        assert!(away.contains("cluster echo-1 has no session (away since "), "{away}");
        Ok(())
    }
}
