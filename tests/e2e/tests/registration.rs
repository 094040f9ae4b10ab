//! Registration and identity end to end, with the real binaries: bootstrap tokens, OCM's double
//! opt-in, refusals with reasons, revocation, renewal over the live session, isolation between
//! clusters, and joining through a real HTTP forward proxy.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use flotilla_e2e::on_both_carriers;
use flotilla_e2e::{Hub, Proc, bin, condition_status, start_tinyproxy, wait_for};
use nix::sys::signal::Signal;
use serde_json::Value;
use tokio::time::Instant;

const AVAILABLE: &str = "ManagedClusterConditionAvailable";
/// OCM's condition of the hub's decision on a cluster's join.
const HUB_ACCEPTED: &str = "HubAcceptedManagedCluster";

/// Waits until `cluster`'s HubAcceptedManagedCluster condition has `status` and `reason`.
async fn wait_hub_accepted(
    hub: &Hub,
    cluster: &str,
    status: &str,
    reason: &str,
) -> anyhow::Result<()> {
    wait_for(
        &format!("{cluster} {HUB_ACCEPTED}={status} ({reason})"),
        LONG,
        || async {
            let mc = self::cluster(hub, cluster)?.unwrap_or_default();
            let found = mc["status"]["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == HUB_ACCEPTED))
                .is_some_and(|c| c["status"] == status && c["reason"] == reason);
            Ok(found.then_some(()))
        },
    )
    .await
}

/// A process log without terminal colour codes, so structured fields read `key=value`.
fn plain(log: String) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // Skip to the end of the escape sequence (a letter).
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
const LONG: Duration = Duration::from_secs(30);

/// `flotilla token create ... -o json`, parsed (holds `token`, `id`, `caFingerprint`, `hub`).
fn create_token(hub: &Hub, args: &[&str]) -> anyhow::Result<Value> {
    let mut all = vec!["token", "create", "-o", "json"];
    all.extend_from_slice(args);
    let out = hub.cli(&all)?;
    anyhow::ensure!(
        out.status.success(),
        "token create failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Runs the `flotilla` CLI and requires success.
fn cli_ok(hub: &Hub, args: &[&str]) -> anyhow::Result<String> {
    let out = hub.cli(args)?;
    anyhow::ensure!(
        out.status.success(),
        "flotilla {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The join command a token prints, run as a process for `cluster` with a data dir of its own
/// (a spoke of its own), token passed through the environment as the docs advise, plus `extra`
/// flags. Returns the process and its data dir.
fn start_join(
    dir: &Path,
    token: &Value,
    cluster: &str,
    extra: &[&str],
) -> anyhow::Result<(Proc, PathBuf)> {
    let data = (1..)
        .map(|n| dir.join(format!("{cluster}-data-{n}")))
        .find(|p| !p.exists())
        .expect("a free data dir");
    std::fs::create_dir_all(&data)?;
    start_join_in(dir, token, cluster, &data, extra)
}

/// [`start_join`] on an existing data dir (the same spoke, restarted).
fn start_join_in(
    dir: &Path,
    token: &Value,
    cluster: &str,
    data: &Path,
    extra: &[&str],
) -> anyhow::Result<(Proc, PathBuf)> {
    let data = data.to_path_buf();
    let kubeconfig = flotilla_e2e::no_spoke_kubeconfig(dir)?;
    let mut cmd = Command::new(bin("flotilla-agent"));
    cmd.arg("join")
        .args(["--hub", token["hub"].as_str().unwrap_or_default()])
        .args(["--cluster-name", cluster])
        .args([
            "--ca-fingerprint",
            token["caFingerprint"].as_str().unwrap_or_default(),
        ])
        .env(
            "FLOTILLA_BOOTSTRAP_TOKEN",
            token["token"].as_str().unwrap_or_default(),
        )
        .arg("--data-dir")
        .arg(&data)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args([
            "--initial-jitter=0s",
            "--max-backoff=1s",
            "--kubernetes-version=v1.36.3",
        ])
        // Behind a forward proxy the agent's automatic choice is gRPC (a proxy carries TCP).
        .arg(if extra.iter().any(|e| e.contains("--proxy-url")) {
            "--transport=auto".to_string()
        } else {
            format!("--transport={}", flotilla_e2e::current_carrier())
        })
        .args(extra)
        .env("RUST_LOG", "info");
    let log = (1..)
        .map(|n| dir.join(format!("join-{cluster}-{n}.log")))
        .find(|p| !p.exists())
        .expect("a free log name");
    Ok((Proc::spawn("flotilla-agent", cmd, log)?, data))
}

fn cluster(hub: &Hub, name: &str) -> anyhow::Result<Option<Value>> {
    Ok(hub
        .clusters()?
        .into_iter()
        .find(|c| c["metadata"]["name"] == name))
}

async fn wait_log(what: &str, log: impl Fn() -> String, needle: &str) -> anyhow::Result<String> {
    wait_for(what, LONG, || async {
        Ok(log()
            .lines()
            .find(|l| l.contains(needle))
            .map(str::to_string))
    })
    .await
}

/// Waits for a refused join: the agent exits non-zero with `reason` in its log, and the hub's
/// log has a `join refused` line with it.
async fn expect_refused(hub: &Hub, agent: &mut Proc, reason: &str) -> anyhow::Result<()> {
    wait_for("the refused agent to exit", LONG, || {
        let alive = agent.alive();
        async move { Ok((!alive).then_some(())) }
    })
    .await?;
    let log = plain(agent.log());
    assert!(
        log.contains("join failed") && log.contains(reason),
        "agent log must state {reason:?}:\n{log}"
    );
    let line = wait_log(
        "the hub to log the refusal",
        || plain(hub.proc.log()),
        reason,
    )
    .await?;
    assert!(
        line.contains("join refused"),
        "hub log must say the join was refused: {line}"
    );
    Ok(())
}

/// Sessions established for `name` according to the hub's log.
fn sessions_established(hub: &Hub, name: &str) -> usize {
    plain(hub.proc.log())
        .lines()
        .filter(|l| l.contains("session established") && l.contains(&format!("cluster={name}")))
        .count()
}

async fn join_pending_accept_available(kube: bool) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let env = if kube {
        let env = flotilla_testenv::TestEnv::start().await?;
        env.install_crds(&flotilla_testenv::workspace_root().join("deploy/crds"))
            .await?;
        Some(env)
    } else {
        None
    };
    let kubeconfig = env
        .as_ref()
        .map(|e| e.kubeconfig_path().to_str().unwrap().to_string());
    let extra: Vec<&str> = match &kubeconfig {
        Some(k) => vec!["--store=kube", "--kubeconfig", k],
        None => vec![],
    };
    let hub = Hub::start(dir.path(), &extra).await?;

    let token = create_token(&hub, &["--ttl", "1h", "--uses", "1"])?;
    let secret = token["token"].as_str().unwrap().to_string();
    let join_command = token["joinCommand"].as_str().unwrap();
    assert!(
        join_command.starts_with(&format!(
            "FLOTILLA_BOOTSTRAP_TOKEN={secret} flotilla-agent join --hub "
        )) && join_command.contains("--ca-fingerprint "),
        "{join_command}"
    );
    assert!(
        !join_command.contains("--token"),
        "the secret is not an argument: {join_command}"
    );
    let (mut agent, data) = start_join(dir.path(), &token, "store-0001", &[])?;

    // Pending: recorded, not accepted, no session, no certificate.
    wait_log(
        "the hub to record the join",
        || plain(hub.proc.log()),
        "join request pending",
    )
    .await?;
    let mc = cluster(&hub, "store-0001")?.expect("ManagedCluster recorded");
    assert_eq!(mc["spec"]["hubAcceptsClient"], false, "{mc}");
    assert_eq!(
        condition_status(&mc, AVAILABLE),
        None,
        "no session yet: {mc}"
    );
    // Never accepted: no acceptance condition at all, as on OCM's hub.
    assert_eq!(condition_status(&mc, HUB_ACCEPTED), None, "{mc}");
    wait_log(
        "the agent to report pending",
        || plain(agent.log()),
        "join request pending",
    )
    .await?;
    assert!(!data.join("identity/tls.crt").exists());
    assert_eq!(sessions_established(&hub, "store-0001"), 0);

    // Accept: the waiting agent gets its certificate and holds a session.
    cli_ok(&hub, &["cluster", "accept", "store-0001"])?;
    hub.wait_available("store-0001").await?;
    wait_hub_accepted(&hub, "store-0001", "True", "HubClusterAdminAccepted").await?;
    assert!(agent.alive());
    let mc = cluster(&hub, "store-0001")?.unwrap();
    assert_eq!(mc["spec"]["hubAcceptsClient"], true);

    if let Some(env) = &env {
        // What kubectl shows on the hub apiserver: NAME, HUB ACCEPTED, JOINED, AVAILABLE, AGE.
        let out = env
            .kubectl()
            .args(["get", "managedclusters", "--no-headers"])
            .output()?;
        let text = String::from_utf8(out.stdout)?;
        let row: Vec<&str> = text
            .lines()
            .find(|l| l.starts_with("store-0001"))
            .map(|l| l.split_whitespace().collect())
            .unwrap_or_default();
        assert_eq!(row.get(1..4), Some(&["true", "True", "True"][..]), "{text}");
    }

    // The single-use token is spent; the key stayed on the spoke, private.
    let tokens: Value = serde_json::from_str(&cli_ok(&hub, &["token", "list", "-o", "json"])?)?;
    assert_eq!(tokens["items"][0]["state"], "used up", "{tokens}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(data.join("identity/tls.key"))?
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // No secret in any log: not the token's, not the key.
    let key = std::fs::read_to_string(data.join("identity/tls.key"))?;
    let key_body = key.lines().nth(1).unwrap_or("no key");
    let token_secret = secret.split_once('.').unwrap().1;
    for log in [hub.proc.log(), agent.log()] {
        assert!(!log.contains(token_secret), "token secret in a log");
        assert!(!log.contains(key_body), "private key in a log");
    }
    agent.signal_and_wait(Signal::SIGTERM);
    Ok(())
}

on_both_carriers! {
    async fn token_join_pending_accept_available_on_sled() -> anyhow::Result<()> {
        join_pending_accept_available(false).await
    }
}

on_both_carriers! {
    async fn token_join_pending_accept_available_on_kube() -> anyhow::Result<()> {
        join_pending_accept_available(true).await
    }
}

on_both_carriers! {
    async fn bad_joins_are_refused_with_reasons_while_others_are_served() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(dir.path(), &[]).await?;

        // A cluster that joins with an auto-accepting token and keeps its session throughout.
        let auto = create_token(&hub, &["--auto-accept-labels", "env=test"])?;
        let (_good, _) = start_join(dir.path(), &auto, "store-good", &[])?;
        hub.wait_available("store-good").await?;
        let mc = cluster(&hub, "store-good")?.unwrap();
        assert_eq!(mc["metadata"]["labels"]["env"], "test", "{mc}");

        // Expired.
        let expired = create_token(&hub, &["--ttl", "1s"])?;
        wait_for("the token to expire", LONG, || async {
            let list: Value = serde_json::from_str(&cli_ok(&hub, &["token", "list", "-o", "json"])?)?;
            Ok(list["items"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|t| t["id"] == expired["id"] && t["state"] == "expired")
                .then_some(()))
        })
        .await?;
        let (mut agent, _) = start_join(dir.path(), &expired, "store-expired", &[])?;
        expect_refused(&hub, &mut agent, "expired at").await?;

        // Revoked.
        let revoked = create_token(&hub, &[])?;
        cli_ok(&hub, &["token", "revoke", revoked["id"].as_str().unwrap()])?;
        let (mut agent, _) = start_join(dir.path(), &revoked, "store-revoked", &[])?;
        expect_refused(&hub, &mut agent, "was revoked").await?;

        // Single use, used twice: the first join is recorded, the second refused.
        let once = create_token(&hub, &["--uses", "1"])?;
        let (_first, _) = start_join(dir.path(), &once, "store-once-a", &[])?;
        wait_for("the first use to be recorded", LONG, || async {
            Ok(cluster(&hub, "store-once-a")?.map(|_| ()))
        })
        .await?;
        let (mut agent, _) = start_join(dir.path(), &once, "store-once-b", &[])?;
        expect_refused(&hub, &mut agent, "is used up (1 of 1 uses)").await?;

        // Wrong CA pin: the agent refuses the hub before sending anything.
        let mut wrong = create_token(&hub, &[])?;
        wrong["caFingerprint"] = Value::String("ab".repeat(32));
        let (mut agent, _) = start_join(dir.path(), &wrong, "store-pin", &[])?;
        wait_for("the agent with a wrong pin to exit", LONG, || {
            let alive = agent.alive();
            async move { Ok((!alive).then_some(())) }
        })
        .await?;
        assert!(
            agent
                .log()
                .contains("presented no CA with fingerprint ababab"),
            "{}",
            agent.log()
        );
        wait_log(
            "the hub to log the rejected chain",
            || plain(hub.proc.log()),
            "the client rejected the hub's certificate chain",
        )
        .await?;
        assert!(cluster(&hub, "store-pin")?.is_none());

        // A name already taken by another key (store-good's), with a valid token.
        let fresh = create_token(&hub, &[])?;
        let (mut agent, _) = start_join(dir.path(), &fresh, "store-good", &[])?;
        expect_refused(&hub, &mut agent, "already registered with a different key").await?;

        // All the while, store-good kept its one session.
        assert_eq!(
            hub.cluster_condition("store-good", AVAILABLE)?.as_deref(),
            Some("True")
        );
        assert_eq!(sessions_established(&hub, "store-good"), 1);
        Ok(())
    }
}

on_both_carriers! {
    async fn denied_or_deleted_clusters_lose_their_session_at_once_and_stay_out() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(dir.path(), &[]).await?;
        let token = create_token(&hub, &["--auto-accept"])?;
        let (_bystander, _) = start_join(dir.path(), &token, "store-bystander", &[])?;
        let (denied, _) = start_join(dir.path(), &token, "store-denied", &[])?;
        let (deleted, _) = start_join(dir.path(), &token, "store-deleted", &[])?;
        for c in ["store-bystander", "store-denied", "store-deleted"] {
            hub.wait_available(c).await?;
        }

        for (name, agent, args, reason) in [
            (
                "store-denied",
                &denied,
                vec![
                    "cluster",
                    "deny",
                    "store-denied",
                    "--reason",
                    "stolen laptop",
                ],
                "denied by the hub: stolen laptop",
            ),
            (
                "store-deleted",
                &deleted,
                vec!["cluster", "delete", "store-deleted"],
                "not registered with this hub",
            ),
        ] {
            cli_ok(&hub, &args)?;
            let revoked_at = Instant::now();
            // Closed within a second of the operator's command returning.
            wait_for(
                &format!("{name}'s session to close"),
                Duration::from_secs(1),
                || async {
                    Ok(plain(hub.proc.log())
                        .lines()
                        .any(|l| {
                            l.contains("closing the session of a revoked cluster") && l.contains(name)
                        })
                        .then_some(()))
                },
            )
            .await?;
            eprintln!(
                "{name}: session closed {:?} after the command",
                revoked_at.elapsed()
            );
            // The agent comes back with the same certificate and is refused, with the reason.
            wait_for(
                &format!("{name}'s reconnect to be refused"),
                LONG,
                || async {
                    Ok(plain(hub.proc.log())
                        .lines()
                        .any(|l| {
                            l.contains("session refused") && l.contains(name) && l.contains(reason)
                        })
                        .then_some(()))
                },
            )
            .await?;
            wait_log(
                &format!("{name}'s agent to learn why"),
                || plain(agent.log()),
                reason,
            )
            .await?;
        }
        assert_eq!(
            hub.cluster_condition("store-bystander", AVAILABLE)?
                .as_deref(),
            Some("True")
        );
        assert_eq!(sessions_established(&hub, "store-bystander"), 1);
        // OCM's condition says what the hub decided: accepted by the token, then denied.
        wait_hub_accepted(&hub, "store-bystander", "True", "HubClusterAdminAccepted").await?;
        wait_hub_accepted(&hub, "store-denied", "False", "HubClusterAdminDenied").await?;
        Ok(())
    }
}

on_both_carriers! {
    async fn certificate_renews_over_the_live_session_without_a_gap() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(dir.path(), &["--client-cert-lifetime=6s"]).await?;
        let token = create_token(&hub, &["--auto-accept"])?;
        let (mut agent, data) = start_join(dir.path(), &token, "store-renew", &[])?;
        hub.wait_available("store-renew").await?;
        let first_cert = std::fs::read_to_string(data.join("identity/tls.crt"))?;
        let since = |mc: &Value| {
            mc["status"]["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == AVAILABLE))
                .map(|c| c["lastTransitionTime"].clone())
        };
        let available_since = since(&cluster(&hub, "store-renew")?.unwrap());

        // Two renewals, each before two thirds of a 6 s lifetime; Available stays True all along.
        wait_for("two renewals", LONG, || async {
            let mc = cluster(&hub, "store-renew")?.unwrap();
            anyhow::ensure!(
                condition_status(&mc, AVAILABLE).as_deref() == Some("True")
                    && since(&mc) == available_since,
                "Available changed during renewal: {mc}"
            );
            Ok((agent.log().matches("client certificate renewed").count() >= 2).then_some(()))
        })
        .await?;
        assert_eq!(
            sessions_established(&hub, "store-renew"),
            1,
            "renewal must not reconnect"
        );
        let renewed = std::fs::read_to_string(data.join("identity/tls.crt"))?;
        assert_ne!(renewed, first_cert);
        assert_eq!(
            hub.proc
                .log()
                .matches("client certificate renewed over the session")
                .count(),
            agent.log().matches("client certificate renewed").count()
        );

        // The next connection uses the renewed certificate: after two renewals the first key is
        // no longer registered (the hub keeps the newest two), so only the renewed one gets in.
        agent.signal_and_wait(Signal::SIGKILL);
        let (_again, _) = start_join_in(dir.path(), &token, "store-renew", &data, &[])?;
        wait_for("a second session", LONG, || async {
            Ok((sessions_established(&hub, "store-renew") == 2).then_some(()))
        })
        .await?;
        Ok(())
    }
}

on_both_carriers! {
    async fn a_session_cannot_write_another_clusters_status() -> anyhow::Result<()> {
        use flotilla_e2e::RawSession;
        use flotilla_proto::wire::{AgentFrame, Hello, WorkStatus, agent_frame::Frame, hub_frame};

        let dir = tempfile::tempdir()?;
        let hub = Hub::start(dir.path(), &[]).await?;
        for c in ["store-a", "store-b"] {
            hub.dev_cert(c, &dir.path().join(c))?;
        }
        let manifest = dir.path().join("cm.yaml");
        std::fs::write(
            &manifest,
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings, namespace: default}\ndata: {k: v}\n",
        )?;
        cli_ok(
            &hub,
            &[
                "work",
                "create",
                "web",
                "-f",
                manifest.to_str().unwrap(),
                "--clusters",
                "store-b",
            ],
        )?;
        let works: Value = serde_json::from_str(&cli_ok(
            &hub,
            &["get", "works", "--cluster", "store-b", "-o", "json"],
        )?)?;
        let uid = works["items"][0]["metadata"]["uid"]
            .as_str()
            .expect("store-b's work has a uid")
            .to_string();

        let hello = |cluster: &str| AgentFrame {
            frame: Some(Frame::Hello(Hello {
                protocol_version: flotilla_proto::PROTOCOL_VERSION,
                cluster_name: cluster.into(),
                agent_version: "test".into(),
                ..Default::default()
            })),
        };
        let certs = dir.path().join("store-a");

        // store-a's certificate cannot say hello as store-b.
        let mut forged = RawSession::open(&hub, &certs, hello("store-b")).await?;
        let goodbye = forged.next().await.and_then(|f| f.frame);
        assert!(
            matches!(&goodbye, Some(hub_frame::Frame::Goodbye(g)) if g.reason.contains("certificate identity store-a does not match hello cluster store-b")),
            "{goodbye:?}"
        );

        // Hello as itself, then a status for store-b's work: ignored, logged, nothing stored.
        let mut session = RawSession::open(&hub, &certs, hello("store-a")).await?;
        let welcome = session.next().await.and_then(|f| f.frame);
        assert!(
            matches!(welcome, Some(hub_frame::Frame::Welcome(_))),
            "{welcome:?}"
        );
        let forged = serde_json::json!({"conditions": [{"type": "Applied", "status": "True",
            "reason": "Forged", "message": "written by store-a", "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
        session
            .outbound
            .send(AgentFrame {
                frame: Some(Frame::WorkStatus(WorkStatus {
                    uid: uid.clone(),
                    generation: 1,
                    seq: 1,
                    status_json: serde_json::to_vec(&forged)?,
                })),
            })
            .await?;
        let line = wait_log(
            "the hub to refuse the foreign status",
            || plain(hub.proc.log()),
            "status for neither a work nor a policy of this cluster; ignored",
        )
        .await?;
        assert!(
            line.contains("cluster=store-a") && line.contains(&uid),
            "{line}"
        );
        let works: Value = serde_json::from_str(&cli_ok(
            &hub,
            &["get", "works", "--cluster", "store-b", "-o", "json"],
        )?)?;
        assert!(
            !works.to_string().contains("Forged"),
            "store-b's work must not carry store-a's status: {works}"
        );
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_and_session_go_through_a_forward_proxy() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let hub = Hub::start(dir.path(), &[]).await?;
    let token = create_token(&hub, &["--auto-accept"])?;
    let hub_port = hub.agents_addr.rsplit_once(':').unwrap().1.to_string();

    // Debian's tinyproxy, on loopback, allowing CONNECT to the hub's port only.
    let (_proxy, port) = start_tinyproxy(dir.path(), hub_port.parse()?).await?;
    let proxy_log = dir.path().join("tinyproxy.log");
    let proxy_url = format!("http://127.0.0.1:{port}");
    let (agent, _) = start_join(
        dir.path(),
        &token,
        "store-proxied",
        &["--proxy-url", &proxy_url],
    )?;
    hub.wait_available("store-proxied").await?;
    assert!(agent.log().contains("joined: certificate stored"));

    // Both the join and the session went through the proxy: two CONNECTs to the hub.
    let connects = std::fs::read_to_string(&proxy_log)?
        .lines()
        .filter(|l| l.contains(&format!("CONNECT 127.0.0.1:{hub_port}")))
        .count();
    assert!(
        connects >= 2,
        "expected the join and the session to CONNECT through tinyproxy:\n{}",
        std::fs::read_to_string(&proxy_log)?
    );
    Ok(())
}

on_both_carriers! {
    async fn ca_rotation_reaches_live_agents_and_old_and_new_identities_keep_working() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(dir.path(), &[]).await?;
        let before = create_token(&hub, &["--auto-accept"])?;
        let (mut agent, data) = start_join(dir.path(), &before, "store-old", &[])?;
        hub.wait_available("store-old").await?;

        let shown = cli_ok(&hub, &["ca", "rotate"])?;
        assert!(shown.contains("in progress"), "{shown}");
        // The live session hears the new bundle (old + new CA) and keeps going.
        wait_log(
            "the agent to store the new bundle",
            || plain(agent.log()),
            "the hub's CA bundle changed",
        )
        .await?;
        let bundle = std::fs::read_to_string(data.join("identity/ca.crt"))?;
        assert_eq!(bundle.matches("BEGIN CERTIFICATE").count(), 2);
        assert_eq!(sessions_established(&hub, "store-old"), 1);

        // Restarted, the agent (client certificate from the old CA) meets a serving chain from the
        // new CA, and both sides accept the other.
        agent.signal_and_wait(Signal::SIGKILL);
        let (_agent, _) = start_join_in(dir.path(), &before, "store-old", &data, &[])?;
        wait_for("a second session for store-old", LONG, || async {
            Ok((sessions_established(&hub, "store-old") == 2).then_some(()))
        })
        .await?;

        // New joins pin the new CA's fingerprint.
        let after = create_token(&hub, &["--auto-accept"])?;
        assert_ne!(after["caFingerprint"], before["caFingerprint"]);
        let (_new, _) = start_join(dir.path(), &after, "store-new", &[])?;
        hub.wait_available("store-new").await?;
        Ok(())
    }
}
