//! The plain-HTTP listener of `--metrics-addr`: `GET /metrics` (OpenMetrics text to a scraper
//! that asks for it, as Prometheus does; the Prometheus text format to others), `GET /healthz` (the process answers: it is alive) and `GET /readyz` (200 `ok`
//! when every readiness condition holds, else 503 with a line per condition that does not).
//!
//! It carries no secrets and no per-cluster data, so it needs no TLS: bind it to loopback or
//! to the pod's address, as kube components do with their metrics port. Connections are
//! bounded in number and in time, so a stuck scraper costs the process nothing else.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{debug, warn};

use crate::logging::LogFormat;
use crate::readiness::Readiness;

/// Connections served at once; more wait in the listen backlog. A scraper and two probes need
/// three.
pub const MAX_CONNECTIONS: usize = 16;
/// How long one connection may live: a scrape takes milliseconds.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client may take to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// The media type of `/metrics` for scrapers that ask for OpenMetrics (Prometheus asks for it
/// first): what prometheus-client writes.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The media type of `/metrics` for every other scraper: the Prometheus text format.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The flags every binary takes for its operators.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct MetricsArgs {
    /// Plain-HTTP address for operators' probes and scrapes: GET /metrics (Prometheus metrics,
    /// every name under flotilla_), /healthz (alive) and /readyz (ready to serve; 503 with what
    /// is missing otherwise). No TLS and no client certificate: bind it to loopback or to the
    /// pod's address, not to the internet. Off when not given.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// How log lines are written to stderr: text (one line per event) or json (one object per
    /// line, for log collectors). RUST_LOG filters either (default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Why the endpoint cannot serve. Not retryable without a change of flags.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The address is taken or not this host's.
    #[error("cannot listen for metrics and probes on {address} (--metrics-addr): {source}")]
    Bind {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// What one process serves on its metrics address.
pub struct Endpoint {
    registry: Registry,
    readiness: Readiness,
    /// Run before each scrape: gauges that are cheaper to read when asked than to keep
    /// current (a queue's length, a count in a database) set themselves here.
    refresh: Vec<Box<dyn Fn() + Send + Sync>>,
}

impl Endpoint {
    pub fn new(registry: Registry, readiness: Readiness) -> Endpoint {
        Endpoint {
            registry,
            readiness,
            refresh: Vec::new(),
        }
    }

    /// Adds a function run before each scrape.
    pub fn refresh_with(mut self, refresh: impl Fn() + Send + Sync + 'static) -> Endpoint {
        self.refresh.push(Box::new(refresh));
        self
    }

    /// The text of `/metrics`.
    pub fn metrics_text(&self) -> String {
        for refresh in &self.refresh {
            refresh();
        }
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    /// The answer to `/readyz`.
    pub fn readyz(&self) -> (StatusCode, String) {
        let missing = self.readiness.missing();
        if missing.is_empty() {
            return (StatusCode::OK, "ok\n".into());
        }
        let mut text = String::from("not ready:\n");
        for m in missing {
            text.push_str("- ");
            text.push_str(m);
            text.push('\n');
        }
        (StatusCode::SERVICE_UNAVAILABLE, text)
    }

    fn answer(&self, request: &Request<Incoming>) -> Response<Full<Bytes>> {
        let text = |status: StatusCode, body: String| {
            let mut r = Response::new(Full::new(Bytes::from(body)));
            *r.status_mut() = status;
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            r
        };
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{} is not served here: use GET\n", request.method()),
            );
        }
        match request.uri().path() {
            "/metrics" => {
                let openmetrics =
                    request
                        .headers()
                        .get_all(hyper::header::ACCEPT)
                        .iter()
                        .any(|v| {
                            v.to_str()
                                .is_ok_and(|v| v.contains("application/openmetrics-text"))
                        });
                let (body, media_type) = if openmetrics {
                    (self.metrics_text(), METRICS_CONTENT_TYPE)
                } else {
                    (
                        prometheus_text(&self.metrics_text()),
                        PROMETHEUS_CONTENT_TYPE,
                    )
                };
                let mut r = text(StatusCode::OK, body);
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static(media_type),
                );
                r
            }
            "/healthz" | "/livez" => text(StatusCode::OK, "ok\n".into()),
            "/readyz" => {
                let (status, body) = self.readyz();
                text(status, body)
            }
            other => text(
                StatusCode::NOT_FOUND,
                format!("{other}: not found; this address serves /metrics, /healthz and /readyz\n"),
            ),
        }
    }
}

/// OpenMetrics text as the Prometheus text format (0.0.4) says it: a counter's HELP and TYPE
/// name its `_total` samples, and there are no `# UNIT` or `# EOF` lines. Samples are the same.
pub fn prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut text = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let declared = ["# HELP ", "# TYPE "]
            .iter()
            .find_map(|p| Some((*p, line.strip_prefix(p)?)));
        match declared {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                text.push_str(prefix);
                text.push_str(name);
                if counters.contains(name) {
                    text.push_str("_total");
                }
                text.push(' ');
                text.push_str(if tail == "unknown" { "untyped" } else { tail });
            }
            None => text.push_str(line),
        }
        text.push('\n');
    }
    text
}

/// Binds `address` for [`serve`].
pub async fn bind(address: SocketAddr) -> Result<TcpListener, EndpointError> {
    TcpListener::bind(address)
        .await
        .map_err(|source| EndpointError::Bind { address, source })
}

/// Serves `endpoint` on `listener` until `shutdown` completes; then closes the connections
/// still open. Failures of single connections are logged and end only them.
pub async fn serve(
    listener: TcpListener,
    endpoint: Arc<Endpoint>,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: wait a moment rather than spin.
                    warn!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            _ = &mut shutdown => break,
        };
        let endpoint = endpoint.clone();
        connections.spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let response = endpoint.answer(&request);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(%peer, error = %e, "metrics connection failed"),
                Err(_) => debug!(%peer, "metrics connection closed after its time limit"),
            }
        });
        while connections.try_join_next().is_some() {}
    }
    connections.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readiness::ReadyFlag;
    use prometheus_client::metrics::counter::Counter;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    async fn get(address: SocketAddr, path: &str) -> String {
        get_accepting(address, path, "*/*").await
    }

    async fn get_accepting(address: SocketAddr, path: &str, accept: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer
    }

    #[tokio::test]
    async fn serves_metrics_health_and_readiness_with_what_is_missing() {
        let mut registry = crate::registry();
        let requests = Counter::<u64>::default();
        registry.register("test_requests", "Requests seen.", requests.clone());
        let cache = ReadyFlag::new("the cache has not listed yet");
        let endpoint = Arc::new(Endpoint::new(registry, Readiness::new([cache.clone()])));
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let server = tokio::spawn(serve(listener, endpoint, async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        }));

        let readyz = get(address, "/readyz").await;
        assert!(readyz.starts_with("HTTP/1.1 503"), "{readyz}");
        assert!(
            readyz.contains("- the cache has not listed yet"),
            "{readyz}"
        );
        cache.set(true);
        let readyz = get(address, "/readyz").await;
        assert!(readyz.starts_with("HTTP/1.1 200"), "{readyz}");

        requests.inc();
        // Prometheus asks for OpenMetrics first; anyone else gets the Prometheus text format.
        // Both are read by the strict reader, with the same samples.
        let accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
        let openmetrics = get_accepting(address, "/metrics", accept).await;
        let plain = get(address, "/metrics").await;
        assert!(openmetrics.contains(METRICS_CONTENT_TYPE), "{openmetrics}");
        assert!(
            openmetrics.contains("# TYPE flotilla_test_requests counter\r\n")
                || openmetrics.contains("# TYPE flotilla_test_requests counter\n"),
            "{openmetrics}"
        );
        assert!(plain.contains(PROMETHEUS_CONTENT_TYPE), "{plain}");
        assert!(
            plain.contains("# TYPE flotilla_test_requests_total counter\n"),
            "{plain}"
        );
        assert!(!plain.contains("# EOF"), "{plain}");
        for page in [&openmetrics, &plain] {
            let body = page.split_once("\r\n\r\n").unwrap().1;
            let read = crate::exposition::check(body).unwrap();
            assert_eq!(read.value("flotilla_test_requests_total", &[]), Some(1.0));
        }
        assert!(get(address, "/healthz").await.starts_with("HTTP/1.1 200"));
        let unknown = get(address, "/nope").await;
        assert!(
            unknown.starts_with("HTTP/1.1 404") && unknown.contains("/readyz"),
            "{unknown}"
        );

        stop_tx.send_replace(true);
        server.await.unwrap();
    }
}
