//! One HTTP/1.1 request over TLS, written as given (the request target byte for byte, any
//! headers), with whatever client certificate the test presents, or none: how tests reach the
//! hub's operator API and proxy front as kubectl or the CLI never would.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_rustls::rustls;

use crate::scripted::read_head;

/// How long one request may take, connection and answer included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// A request as it goes on the wire.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    /// The request target, sent as is (`/clusters/x/../y?watch=1`).
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn new(method: &str, target: &str) -> Request {
        Request {
            method: method.to_string(),
            target: target.to_string(),
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Request {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    pub fn json(mut self, body: &serde_json::Value) -> Request {
        self.body = body.to_string().into_bytes();
        self.header("Content-Type", "application/json")
    }
}

/// The answer: status, head (status line and headers) and body.
#[derive(Clone, Debug)]
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

/// Sends `request` to `address` (host:port, TLS server name `127.0.0.1`) with `tls` and reads
/// the answer. An error is a connection or TLS failure (a client certificate refused at the
/// handshake, say), never an HTTP status.
pub async fn send(
    address: &str,
    tls: Arc<rustls::ClientConfig>,
    request: &Request,
) -> anyhow::Result<Answer> {
    tokio::time::timeout(REQUEST_TIMEOUT, exchange(address, tls, request))
        .await
        .with_context(|| {
            format!(
                "{} {} to {address} did not finish within {REQUEST_TIMEOUT:?}",
                request.method, request.target
            )
        })?
}

async fn exchange(
    address: &str,
    tls: Arc<rustls::ClientConfig>,
    request: &Request,
) -> anyhow::Result<Answer> {
    let tcp = TcpStream::connect(address).await?;
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1")?;
    let mut conn = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await?;
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: {address}\r\n",
        request.method, request.target
    );
    for (name, value) in &request.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !request
        .headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("connection"))
    {
        head.push_str("Connection: close\r\n");
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", request.body.len()));
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(&request.body).await?;
    conn.flush().await?;

    let head = read_head(&mut conn).await?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let body = if status == 101 {
        Vec::new()
    } else if header("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        read_chunked(&mut conn).await?
    } else if let Some(length) = header("content-length") {
        let mut body = vec![0; length.parse()?];
        conn.read_exact(&mut body).await?;
        body
    } else {
        let mut body = Vec::new();
        conn.read_to_end(&mut body).await?;
        body
    };
    Ok(Answer {
        status,
        head,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

async fn read_chunked<S: tokio::io::AsyncRead + Unpin>(conn: &mut S) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let mut line = Vec::new();
        while !line.ends_with(b"\r\n") {
            line.push(conn.read_u8().await?);
        }
        let size = usize::from_str_radix(
            String::from_utf8(line)?
                .trim()
                .split(';')
                .next()
                .unwrap_or(""),
            16,
        )?;
        let mut chunk = vec![0; size + 2];
        conn.read_exact(&mut chunk).await?;
        if size == 0 {
            return Ok(body);
        }
        body.extend_from_slice(&chunk[..size]);
    }
}
