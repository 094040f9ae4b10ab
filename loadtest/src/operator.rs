//! The hub's operator API, as the harness uses it: the same HTTPS endpoints and operator
//! credentials as the `flotilla` CLI, over a small pool of kept-alive connections so that
//! registering ten thousand clusters is not ten thousand TLS handshakes.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use flotilla_hub::client::OperatorConfig;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tokio_rustls::TlsConnector;

/// Connections kept open to the operator API.
pub const POOL_SIZE: usize = 8;

/// A client of one hub's operator API.
pub struct OperatorApi {
    address: String,
    host: String,
    tls: TlsConnector,
    /// Idle connections; a request takes one (or dials) and puts it back when done.
    idle: Mutex<Vec<SendRequest<Full<Bytes>>>>,
}

impl OperatorApi {
    /// Reads `<data-dir>/operator/config.yaml`, as the hub wrote it.
    pub fn from_data_dir(data_dir: &Path) -> anyhow::Result<Arc<OperatorApi>> {
        let path = data_dir.join("operator/config.yaml");
        let config = OperatorConfig::load(&path).with_context(|| {
            format!(
                "{} has no operator credentials: is it a flotilla hub's --data-dir?",
                data_dir.display()
            )
        })?;
        let uri: http::Uri = config.server.parse()?;
        let host = uri
            .host()
            .ok_or_else(|| anyhow!("{} has no host", config.server))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let address = format!("{host}:{}", uri.port_u16().unwrap_or(443));
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        let tls = flotilla_gateway::tls::client_config(
            &read(&config.certificate_authority)?,
            &read(&config.client_certificate)?,
            &read(&config.client_key)?,
            &[b"http/1.1"],
        )?;
        Ok(Arc::new(OperatorApi {
            address,
            host,
            tls: TlsConnector::from(tls),
            idle: Mutex::new(Vec::new()),
        }))
    }

    /// host:port of the API.
    pub fn address(&self) -> &str {
        &self.address
    }

    async fn connection(&self) -> anyhow::Result<SendRequest<Full<Bytes>>> {
        while let Some(mut c) = self.idle.lock().await.pop() {
            if c.ready().await.is_ok() {
                return Ok(c);
            }
        }
        let tcp = TcpStream::connect(&self.address)
            .await
            .with_context(|| format!("cannot reach the hub's operator API at {}", self.address))?;
        let tls = self
            .tls
            .connect(ServerName::try_from(self.host.clone())?, tcp)
            .await
            .with_context(|| format!("TLS with the operator API at {} failed", self.address))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        Ok(sender)
    }

    /// One request; the JSON body of a 2xx answer, or an error with the hub's message.
    pub async fn request(
        &self,
        method: http::Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let mut sender = self.connection().await?;
        let bytes = match body {
            Some(b) => serde_json::to_vec(b)?,
            None => Vec::new(),
        };
        let request = http::Request::builder()
            .method(method.clone())
            .uri(path)
            .header(http::header::HOST, &self.address)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(bytes)))?;
        let response = sender
            .send_request(request)
            .await
            .with_context(|| format!("{method} {path}"))?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        if POOL_SIZE > self.idle.lock().await.len() {
            self.idle.lock().await.push(sender);
        }
        let value: Value = serde_json::from_slice(&body).unwrap_or_else(
            |_| serde_json::json!({ "message": String::from_utf8_lossy(&body).trim().to_string() }),
        );
        if !status.is_success() {
            bail!(
                "{method} {path}: hub refused ({status}): {}",
                value["message"].as_str().unwrap_or("no message")
            );
        }
        Ok(value)
    }

    /// Registers (creating if needed) accepted cluster `name` whose agent holds a certificate
    /// for key `key_sha256`: the hub's development path around the join flow.
    pub async fn register_dev_key(&self, name: &str, key_sha256: &str) -> anyhow::Result<()> {
        self.request(
            http::Method::POST,
            &format!("/registration/v1/clusters/{name}/dev-key"),
            Some(&serde_json::json!({ "keySha256": key_sha256 })),
        )
        .await?;
        Ok(())
    }

    /// Every ManagedCluster.
    pub async fn clusters(&self) -> anyhow::Result<Vec<Value>> {
        let list = self
            .request(
                http::Method::GET,
                "/apis/cluster.open-cluster-management.io/v1/managedclusters",
                None,
            )
            .await?;
        Ok(items(list))
    }

    /// Every ManifestWork, in all namespaces.
    pub async fn works(&self) -> anyhow::Result<Vec<Value>> {
        let list = self
            .request(
                http::Method::GET,
                "/apis/work.open-cluster-management.io/v1/manifestworks",
                None,
            )
            .await?;
        Ok(items(list))
    }

    /// Creates a ManifestWork in its namespace (the cluster's name).
    pub async fn create_work(&self, work: &Value) -> anyhow::Result<Value> {
        let ns = work["metadata"]["namespace"]
            .as_str()
            .ok_or_else(|| anyhow!("ManifestWork without metadata.namespace"))?;
        self.request(
            http::Method::POST,
            &format!("/apis/work.open-cluster-management.io/v1/namespaces/{ns}/manifestworks"),
            Some(work),
        )
        .await
    }
}

fn items(list: Value) -> Vec<Value> {
    match list {
        Value::Object(mut m) => match m.remove("items") {
            Some(Value::Array(items)) => items,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    }
}

/// Status of condition `t` of an object ("True", "False", "Unknown").
pub fn condition<'a>(obj: &'a Value, t: &str) -> Option<&'a str> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == t)?["status"]
        .as_str()
}
