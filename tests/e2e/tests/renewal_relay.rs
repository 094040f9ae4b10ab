//! Certificate renewal in scale-out mode: a `flotilla-gateway` holds no CA key, so it relays an
//! agent's renewal to the hub as a CertificateSigningRequest on the real hub apiserver, and the
//! hub signs it. An agent that joined with a 6 s certificate renews twice over its session on
//! the gateway without reconnecting, and its renewed certificate opens its next session. A
//! renewal request made by anyone but the gateways' identity is denied, even one naming the
//! cluster and its registered key.

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use flotilla_e2e::{GatewayProc, Hub, Proc, bin, on_both_carriers, wait_for};
use flotilla_proto::contract::{
    KEY_PINS_ANNOTATION, RENEWAL_CLUSTER_LABEL, RENEWAL_SESSION_KEY_ANNOTATION, RENEWAL_SIGNER,
};
use flotilla_testenv::{ADMIN_USER, TestEnv, workspace_root};
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::Api;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(60);
const LEASE_FLAGS: &[&str] = &[
    "--shards=4",
    "--lease-duration=3s",
    "--renew-period=1s",
    "--grace-period=6s",
    "--drain-window=1s",
];
const CLUSTER: &str = "store-relay";

/// Starts `flotilla-agent join` for CLUSTER with `token`, keeping its identity in `data`.
fn join(
    dir: &std::path::Path,
    token: &Value,
    data: &std::path::Path,
    n: u32,
) -> anyhow::Result<Proc> {
    let kubeconfig = flotilla_e2e::no_spoke_kubeconfig(dir)?;
    let mut cmd = Command::new(bin("flotilla-agent"));
    cmd.arg("join")
        .args(["--hub", token["hub"].as_str().unwrap_or_default()])
        .args(["--cluster-name", CLUSTER])
        .args([
            "--ca-fingerprint",
            token["caFingerprint"].as_str().unwrap_or_default(),
        ])
        .env(
            "FLOTILLA_BOOTSTRAP_TOKEN",
            token["token"].as_str().unwrap_or_default(),
        )
        .arg("--data-dir")
        .arg(data)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args([
            "--initial-jitter=0s",
            "--max-backoff=1s",
            "--kubernetes-version=v1.36.3",
        ])
        .arg(format!("--transport={}", flotilla_e2e::current_carrier()))
        .env("RUST_LOG", "info");
    Proc::spawn("flotilla-agent", cmd, dir.join(format!("agent-{n}.log")))
}

/// Sessions the gateway's log shows established for CLUSTER.
fn established(gateway: &GatewayProc) -> usize {
    gateway
        .proc
        .log()
        .lines()
        .filter(|l| l.contains("session established") && l.contains(CLUSTER))
        .count()
}

fn kubectl(env: &TestEnv, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
    let mut child = env
        .kubectl()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .context("kubectl's stdin")?
            .write_all(input.as_bytes())?;
    }
    drop(child.stdin.take());
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

on_both_carriers! {
    async fn a_gateway_relays_renewals_to_the_hub_and_only_gateways_may() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let dir = dir.path();
        let env = TestEnv::start().await?;
        env.install_crds(&workspace_root().join("deploy/crds")).await?;
        let kubeconfig = env.kubeconfig_path().to_path_buf();
        let kc = kubeconfig.to_str().unwrap();
        let requesters = format!("--renewal-requesters={ADMIN_USER}");
        let mut hub_flags = vec![
            "--store=kube",
            "--kubeconfig",
            kc,
            "--gateways=external",
            "--client-cert-lifetime=6s",
            &requesters,
        ];
        hub_flags.extend(LEASE_FLAGS);
        let hub = Hub::start(dir, &hub_flags).await?;
        let certs = hub.gateway_cert(dir)?;
        let gateway = GatewayProc::start(dir, "gw-1", &kubeconfig, &certs, LEASE_FLAGS)?;

        let out = hub.cli(&["token", "create", "--auto-accept", "-o", "json"])?;
        anyhow::ensure!(out.status.success(), "token create: {}", String::from_utf8_lossy(&out.stderr));
        let token: Value = serde_json::from_slice(&out.stdout)?;
        let data = dir.join("spoke-data");
        std::fs::create_dir_all(&data)?;
        let mut agent = join(dir, &token, &data, 1)?;
        wait_for("the agent's session on the gateway", LONG, || async {
            Ok((established(&gateway) == 1).then_some(()))
        })
        .await
        .with_context(|| format!("agent:\n{}\ngateway:\n{}", agent.log(), gateway.proc.log()))?;
        let first_cert = std::fs::read_to_string(data.join("identity/tls.crt"))?;

        // Two renewals before two thirds of each 6 s certificate, relayed by the gateway and
        // signed by the hub, on the one session.
        wait_for("two renewals through the gateway", LONG, || async {
            Ok((agent.log().matches("client certificate renewed").count() >= 2).then_some(()))
        })
        .await
        .with_context(|| format!("agent:\n{}\nhub:\n{}", agent.log(), hub.proc.log()))?;
        assert_eq!(established(&gateway), 1, "renewal must not reconnect:\n{}", agent.log());
        assert!(
            hub.proc.log().matches("client certificate renewed for a gateway's session").count() >= 2,
            "the hub signed them: {}",
            hub.proc.log()
        );
        assert_ne!(std::fs::read_to_string(data.join("identity/tls.crt"))?, first_cert);
        // Answered requests are deleted.
        let csrs: Api<CertificateSigningRequest> = Api::all(env.client().await?);
        wait_for("answered renewal requests deleted", LONG, || async {
            let left = csrs.list(&Default::default()).await?.items;
            Ok(left.is_empty().then_some(()))
        })
        .await?;

        // The renewed certificate opens the next session: after two renewals the first key is
        // no longer registered, so only a renewed one gets in.
        agent.signal_and_wait(Signal::SIGKILL);
        let _again = join(dir, &token, &data, 2)?;
        wait_for("a second session with the renewed certificate", LONG, || async {
            Ok((established(&gateway) == 2).then_some(()))
        })
        .await?;

        // Someone else who may create CertificateSigningRequests asks for this cluster's
        // certificate, naming its registered key: denied, no certificate.
        kubectl(&env, &["create", "clusterrole", "csr-creator", "--verb=create,get", "--resource=certificatesigningrequests"], None)?;
        kubectl(&env, &["create", "clusterrolebinding", "csr-creator", "--clusterrole=csr-creator", "--user=mallory"], None)?;
        let mc: Value = serde_json::from_str(&kubectl(&env, &["get", "managedcluster", CLUSTER, "-o", "json"], None)?)?;
        let key = mc["metadata"]["annotations"][KEY_PINS_ANNOTATION]
            .as_str()
            .and_then(|pins| pins.split(',').next())
            .context("the cluster's registered key")?
            .to_string();
        let mallory_key = rcgen::KeyPair::generate()?;
        let request = rcgen::CertificateParams::new(Vec::<String>::new())?
            .serialize_request(&mallory_key)?
            .pem()?;
        let csr = json!({
            "apiVersion": "certificates.k8s.io/v1",
            "kind": "CertificateSigningRequest",
            "metadata": {
                "name": "not-a-gateway",
                "labels": { RENEWAL_CLUSTER_LABEL: CLUSTER },
                "annotations": { RENEWAL_SESSION_KEY_ANNOTATION: key },
            },
            "spec": {
                "request": ByteString(request.into_bytes()),
                "signerName": RENEWAL_SIGNER,
                "usages": ["digital signature", "client auth"],
            },
        });
        kubectl(&env, &["--as=mallory", "create", "-f", "-"], Some(&csr.to_string()))?;
        let denied = wait_for("the hub's answer to mallory", LONG, || async {
            let csr = csrs.get("not-a-gateway").await?;
            let status = csr.status.unwrap_or_default();
            let denied = status
                .conditions
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "Denied" && c.status == "True");
            Ok(denied.map(|c| (c.message.unwrap_or_default(), status.certificate)))
        })
        .await?;
        assert!(denied.0.contains("mallory") && denied.0.contains("--renewal-requesters"), "{}", denied.0);
        assert!(denied.1.is_none_or(|c| c.0.is_empty()), "no certificate for mallory");
        Ok(())
    }
}
