//! Dialling the hub: TCP (directly or through an HTTP CONNECT proxy, from a chosen source
//! address if asked), then TLS with the agent's client certificate, then HTTP/2 (gRPC).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio_rustls::TlsConnector;
use tonic::transport::{Channel, Endpoint};

use crate::proxy::{self, ProxyUrl};

/// How long one dial (TCP, proxy, TLS and HTTP/2 together) may take before it counts as a
/// failed attempt and the agent backs off: without it a SYN into a black hole waits for the
/// kernel's retries (minutes).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(20);

/// Everything needed to open a connection to the hub. The identity files are read again for
/// every connection, so a certificate renewed over the session (or a new CA bundle) is used
/// from the next connection on without a restart.
#[derive(Clone)]
pub struct Dialer {
    hub: String,
    server_name: ServerName<'static>,
    cert_dir: PathBuf,
    proxy: Option<ProxyUrl>,
    local_address: Option<IpAddr>,
}

impl Dialer {
    /// Checks the identity in `cert_dir` once, so a broken one fails at start.
    pub fn new(hub: &str, server_name: &str, cert_dir: &Path) -> anyhow::Result<Dialer> {
        tls_connector(cert_dir)?;
        Ok(Dialer {
            hub: hub.to_string(),
            server_name: ServerName::try_from(server_name.to_string())
                .with_context(|| format!("{server_name:?} is not a valid server name"))?,
            cert_dir: cert_dir.to_path_buf(),
            proxy: None,
            local_address: None,
        })
    }

    /// Binds each connection's socket to `address` (port chosen by the kernel) before dialling:
    /// for hosts with several addresses, and for the load test, whose thousands of agents need
    /// more source ports than one address has.
    pub fn with_local_address(mut self, address: Option<IpAddr>) -> Dialer {
        self.local_address = address;
        self
    }

    /// Dials through `proxy` (HTTP CONNECT) when given.
    pub fn with_proxy(mut self, proxy: Option<ProxyUrl>) -> Dialer {
        self.proxy = proxy;
        self
    }

    /// Opens one HTTP/2 connection to the hub, within [`DIAL_TIMEOUT`]. Errors carry what
    /// failed (proxy, TCP or TLS).
    pub async fn connect(&self) -> anyhow::Result<Channel> {
        tokio::time::timeout(DIAL_TIMEOUT, self.connect_unbounded())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "connecting to the hub at {}: no answer within {DIAL_TIMEOUT:?}",
                    self.hub
                )
            })?
    }

    async fn connect_unbounded(&self) -> anyhow::Result<Channel> {
        let tls = tls_connector(&self.cert_dir)?;
        let this = self.clone();
        let connector = tower::service_fn(move |_uri: http::Uri| {
            let this = this.clone();
            let tls = tls.clone();
            async move {
                let tcp = proxy::dial(&this.hub, this.proxy.as_ref(), this.local_address).await?;
                let tls = tls.connect(this.server_name.clone(), tcp).await?;
                Ok::<_, std::io::Error>(TokioIo::new(tls))
            }
        });
        // The URI only names the HTTP/2 authority; the connector above does the dialling (and
        // the TLS, which is why the scheme says http).
        let channel = Endpoint::from_shared(format!("http://{}", self.hub))?
            .connect_with_connector(connector)
            .await
            .with_context(|| format!("connecting to the hub at {}", self.hub))?;
        Ok(channel)
    }
}

fn tls_connector(cert_dir: &Path) -> anyhow::Result<TlsConnector> {
    let read = |f: &str| {
        let p = cert_dir.join(f);
        std::fs::read(&p).with_context(|| {
            format!(
                "reading {} (the agent's identity: join first with `flotilla-agent join`, or pass --cert-dir)",
                p.display()
            )
        })
    };
    let config = flotilla_transport::tls::client_config(
        &read("ca.crt")?,
        &read("tls.crt")?,
        &read("tls.key")?,
        &[b"h2"],
    )
    .with_context(|| format!("the agent's identity in {}", cert_dir.display()))?;
    Ok(TlsConnector::from(config))
}
