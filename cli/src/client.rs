//! The operator API's client, used by the `flotilla` CLI and the load test: HTTPS with the
//! operator's client certificate, over a few kept-alive connections so that many requests are
//! not as many TLS handshakes.

use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tokio_rustls::TlsConnector;

/// Idle connections a client keeps for its next requests.
pub const IDLE_CONNECTIONS: usize = 8;
/// The longest one request may take, connecting included (a list of 10,000 clusters takes a
/// few seconds): a hub that stopped answering is an error, never a hang.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The CLI's config file, written by the hub on first start (`<data-dir>/operator/config.yaml`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OperatorConfig {
    /// `https://host:port` of the operator API.
    pub server: String,
    /// `https://host:port` of the proxy front, when the hub serves one (kubeconfigs written
    /// by `flotilla kubeconfig` point at it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_server: Option<String>,
    /// Paths are relative to the config file's directory unless absolute.
    pub certificate_authority: PathBuf,
    pub client_certificate: PathBuf,
    pub client_key: PathBuf,
}

impl OperatorConfig {
    pub fn load(path: &Path) -> anyhow::Result<OperatorConfig> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read the flotilla config {}: pass --config, or set FLOTILLA_CONFIG to the \
                 operator/config.yaml the hub wrote into its data directory",
                path.display()
            )
        })?;
        let mut config: OperatorConfig = yaml_serde::from_str(&text)
            .with_context(|| format!("flotilla config {} does not parse", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [
            &mut config.certificate_authority,
            &mut config.client_certificate,
            &mut config.client_key,
        ] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        Ok(config)
    }
}

pub struct OperatorClient {
    authority: String,
    host: String,
    tls: TlsConnector,
    /// The proxy front's URL, when the hub serves one.
    proxy_server: Option<String>,
    /// Connections whose last response has been read in full; a request takes one (or dials)
    /// and puts it back when done, up to [`IDLE_CONNECTIONS`].
    idle: Mutex<Vec<SendRequest<Full<Bytes>>>>,
}

impl OperatorClient {
    pub fn new(config: &OperatorConfig) -> anyhow::Result<OperatorClient> {
        let uri: http::Uri = config
            .server
            .parse()
            .with_context(|| format!("server {:?} is not a URL", config.server))?;
        if uri.scheme_str() != Some("https") {
            bail!("server {:?} must be an https:// URL", config.server);
        }
        let host = uri
            .host()
            .ok_or_else(|| anyhow!("server {:?} has no host", config.server))?;
        let port = uri.port_u16().unwrap_or(443);
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        let tls = flotilla_transport::tls::client_config(
            &read(&config.certificate_authority)?,
            &read(&config.client_certificate)?,
            &read(&config.client_key)?,
            &[b"http/1.1"],
        )?;
        Ok(OperatorClient {
            authority: format!("{host}:{port}"),
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            tls: TlsConnector::from(tls),
            proxy_server: config.proxy_server.clone(),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// `host:port` of the operator API.
    pub fn address(&self) -> &str {
        &self.authority
    }

    /// `https://host:port` of the hub's proxy front, if it serves one.
    pub fn proxy_server(&self) -> Option<&str> {
        self.proxy_server.as_deref()
    }

    /// An idle connection that is still usable, or a new one.
    async fn connection(&self) -> anyhow::Result<SendRequest<Full<Bytes>>> {
        // The pool's lock is held only to take a connection, never across the wait for it: a
        // connection slow to say it is ready must not hold every other request back.
        loop {
            let pooled = self.idle.lock().await.pop();
            let Some(mut sender) = pooled else { break };
            if sender.ready().await.is_ok() {
                return Ok(sender);
            }
        }
        let tcp = TcpStream::connect(&self.authority).await.with_context(|| {
            format!("cannot reach the hub's operator API at {}", self.authority)
        })?;
        let name = ServerName::try_from(self.host.clone())?;
        let tls = self.tls.connect(name, tcp).await.with_context(|| {
            format!(
                "TLS with the hub at {} failed (is the config's CA the hub's?)",
                self.authority
            )
        })?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        Ok(sender)
    }

    /// GET `path` and return the JSON body; a non-2xx answer becomes an error carrying the
    /// server's message.
    pub async fn get_json(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        self.request(http::Method::GET, path, None)
            .await
            .map(|(_, v)| v)
    }

    /// One request; returns the status and JSON body of a 2xx answer, or an error with the
    /// server's message. `Ok` with a 404/409 status never happens: those are errors too, and
    /// callers that care match on [`ApiError`].
    pub async fn request(
        &self,
        method: http::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<(http::StatusCode, serde_json::Value)> {
        let what = format!("{method} {path}");
        tokio::time::timeout(REQUEST_TIMEOUT, self.request_unbounded(method, path, body))
            .await
            .map_err(|_| {
                anyhow!(
                    "{what}: the hub's operator API at {} did not answer within {REQUEST_TIMEOUT:?}",
                    self.authority
                )
            })?
    }

    /// GET `path` (with its query) as it is: status, headers and body, whatever the status.
    /// How `flotilla dashboard` forwards a browser's request with the operator's certificate.
    pub async fn get_raw(&self, path: &str) -> anyhow::Result<http::Response<Bytes>> {
        tokio::time::timeout(
            REQUEST_TIMEOUT,
            self.send(http::Method::GET, path, Vec::new(), "*/*"),
        )
        .await
        .map_err(|_| {
            anyhow!(
                "GET {path}: the hub's operator API at {} did not answer within {REQUEST_TIMEOUT:?}",
                self.authority
            )
        })?
    }

    /// One request on an idle or new connection, the connection kept for the next one.
    async fn send(
        &self,
        method: http::Method,
        path: &str,
        body: Vec<u8>,
        accept: &str,
    ) -> anyhow::Result<http::Response<Bytes>> {
        let mut sender = self.connection().await?;
        let request = http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, &self.authority)
            .header(http::header::ACCEPT, accept)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let response = sender.send_request(request).await?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await?.to_bytes();
        {
            let mut idle = self.idle.lock().await;
            if idle.len() < IDLE_CONNECTIONS {
                idle.push(sender);
            }
        }
        Ok(http::Response::from_parts(parts, body))
    }

    async fn request_unbounded(
        &self,
        method: http::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<(http::StatusCode, serde_json::Value)> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b)?,
            None => Vec::new(),
        };
        let response = self.send(method, path, bytes, "application/json").await?;
        let status = response.status();
        let body = response.into_body();
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_else(
            |_| serde_json::json!({ "message": String::from_utf8_lossy(&body).trim().to_string() }),
        );
        if !status.is_success() {
            let message = value
                .get("message")
                .and_then(|m| m.as_str())
                .unwrap_or("no message");
            return Err(ApiError {
                status,
                message: message.to_string(),
            }
            .into());
        }
        Ok((status, value))
    }
}

/// A refusal from the operator API.
#[derive(Debug, thiserror::Error)]
#[error("hub refused: {message} ({status})")]
pub struct ApiError {
    pub status: http::StatusCode,
    pub message: String,
}
