//! What a spoke's operator reads when the agent cannot get a session: for every refusal a
//! spoke can meet, the agent's log says in words what happened and what to do. Real agents,
//! a real hub, real certificates, a real forward proxy.

use std::path::Path;
use std::time::Duration;

use flotilla_e2e::on_both_carriers;
use flotilla_e2e::{Hub, Proc, start_agent, start_tinyproxy, wait_for};

/// Waits until the agent's log shows every one of `words` on one line.
async fn says(agent: &Proc, case: &str, words: &[&str]) -> anyhow::Result<()> {
    wait_for(case, Duration::from_secs(30), || async {
        Ok(agent
            .log()
            .lines()
            .any(|line| words.iter().all(|w| line.contains(w)))
            .then_some(()))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e:#}\nthe agent's log:\n{}", agent.log()))
}

/// A certificate for `cluster` from the hub's own CA that expired yesterday.
fn expired_cert(hub: &Hub, cluster: &str, out: &Path) -> anyhow::Result<()> {
    use rcgen::{CertificateParams, DnType, Issuer, KeyPair};
    let ca_dir = hub.data_dir.join("ca");
    let ca_pem = std::fs::read_to_string(ca_dir.join("ca.crt"))?;
    let ca_key = KeyPair::from_pem(&std::fs::read_to_string(ca_dir.join("ca.key"))?)?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, cluster);
    params
        .distinguished_name
        .push(DnType::OrganizationName, "flotilla:clusters");
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(30);
    params.not_after = now - time::Duration::days(1);
    let cert = params.signed_by(&key, &issuer)?;
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("ca.crt"), &ca_pem)?;
    std::fs::write(out.join("tls.crt"), cert.pem())?;
    std::fs::write(out.join("tls.key"), key.serialize_pem())?;
    Ok(())
}

fn cli_ok(hub: &Hub, args: &[&str]) -> anyhow::Result<()> {
    let out = hub.cli(args)?;
    anyhow::ensure!(
        out.status.success(),
        "flotilla {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

on_both_carriers! {
    async fn every_refusal_is_said_in_words_with_what_to_do() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let hub = Hub::start(d, &[]).await?;

        // A certificate from another hub's CA (the agent trusts this hub's CA).
        std::fs::create_dir_all(d.join("other"))?;
        std::fs::create_dir_all(d.join("unused"))?;
        let other = Hub::start(&d.join("other"), &[]).await?;
        other.dev_cert("store-foreign", &d.join("foreign"))?;
        std::fs::copy(hub.data_dir.join("ca/ca.crt"), d.join("foreign/ca.crt"))?;
        let agent = start_agent(d, &hub, "store-foreign", &d.join("foreign"))?;
        says(&agent, "another CA", &["refused this agent's certificate", "not issued by this hub's CA", "join again"]).await?;
        drop(agent);

        // An expired certificate.
        expired_cert(&hub, "store-expired", &d.join("expired"))?;
        let agent = start_agent(d, &hub, "store-expired", &d.join("expired"))?;
        says(&agent, "expired", &["expired certificate", "has expired", "join again with a new bootstrap token"]).await?;
        drop(agent);

        // A cluster the hub no longer knows (deleted).
        hub.dev_cert("store-gone", &d.join("gone"))?;
        cli_ok(&hub, &["cluster", "delete", "store-gone"])?;
        let agent = start_agent(d, &hub, "store-gone", &d.join("gone"))?;
        says(&agent, "unknown cluster", &["refused the session", "not registered", "has no cluster of this name", "join again"]).await?;
        drop(agent);

        // A denied cluster.
        hub.dev_cert("store-denied", &d.join("denied"))?;
        cli_ok(&hub, &["cluster", "deny", "store-denied", "--reason", "stolen device"])?;
        let agent = start_agent(d, &hub, "store-denied", &d.join("denied"))?;
        says(&agent, "denied", &["refused the session", "stolen device", "an operator denied this cluster"]).await?;
        drop(agent);

        // Admission refused: registered, but no longer accepted.
        hub.dev_cert("store-held", &d.join("held"))?;
        let held = d.join("held.yaml");
        std::fs::write(
            &held,
            "apiVersion: cluster.open-cluster-management.io/v1\nkind: ManagedCluster\n\
             metadata: {name: store-held}\nspec: {hubAcceptsClient: false}\n",
        )?;
        cli_ok(&hub, &["apply", "-f", held.to_str().unwrap()])?;
        let agent = start_agent(d, &hub, "store-held", &d.join("held"))?;
        says(&agent, "not accepted", &["refused the session", "not accepted", "must accept the cluster"]).await?;
        drop(agent);

        // The hub unreachable: nothing listens where --hub points.
        hub.dev_cert("store-lost", &d.join("lost"))?;
        let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let lost = Hub {
            agents_addr: closed.to_string(),
            ..Hub::start(&d.join("unused"), &[]).await?
        };
        let agent = start_agent(d, &lost, "store-lost", &d.join("lost"))?;
        match flotilla_e2e::current_carrier() {
            flotilla_e2e::Carrier::Grpc => {
                says(&agent, "unreachable", &["cannot reach the hub at", "Connection refused", "check that the hub is running"]).await?
            }
            // UDP has no refusal: nothing answers, and the agent says so.
            flotilla_e2e::Carrier::Quic => {
                says(&agent, "unreachable", &["did not answer in time", "no QUIC handshake", "UDP to the hub may be blocked", "--transport auto"]).await?
            }
        }
        drop(agent);

        // A forward proxy that refuses the way to the hub (it allows another port only).
        hub.dev_cert("store-proxied", &d.join("proxied"))?;
        let (_proxy, port) = start_tinyproxy(d, 1).await?;
        let spoke_kubeconfig = d.join("no-spoke.kubeconfig");
        let mut cmd = std::process::Command::new(flotilla_e2e::bin("flotilla-agent"));
        cmd.arg("run")
            .args(["--hub", &hub.agents_addr, "--server-name", "localhost"])
            .args(["--cluster-name", "store-proxied", "--transport=auto"])
            .arg("--cert-dir")
            .arg(d.join("proxied"))
            .arg("--data-dir")
            .arg(d.join("proxied-data"))
            .arg("--kubeconfig")
            .arg(&spoke_kubeconfig)
            .args(["--initial-jitter=0s", "--max-backoff=1s", "--kubernetes-version=v1.36.3"])
            .args(["--proxy-url", &format!("http://127.0.0.1:{port}")])
            .env("RUST_LOG", "info");
        let agent = Proc::spawn("flotilla-agent", cmd, d.join("agent-proxied.log"))?;
        says(&agent, "proxy refused", &["the proxy refused the way to the hub", "403", "access list"]).await?;
        Ok(())
    }
}
