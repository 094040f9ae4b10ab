//! Where the agent's tunnel end sends kubectl requests: the spoke's apiserver, behind
//! [`SpokeApi`]. [`KubeSpoke`] is the real one (the agent's kubeconfig: its server, its CA,
//! its credentials); the load test plugs in an in-process responder instead.
//!
//! Requests and responses are plain `http` types with boxed streaming bodies, so a watch or a
//! `logs -f` streams through as the apiserver writes it and an upgrade (`101 Switching
//! Protocols`) keeps hyper's upgrade handle in the response's extensions.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::BodyExt as _;
use http_body_util::combinators::BoxBody;
use kube::client::ConfigExt as _;
use tower::ServiceExt as _;

/// Errors of bodies and services, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;
/// A request or response body streaming through a tunnel.
pub type TunnelBody = BoxBody<Bytes, BoxError>;

/// The spoke's Kubernetes API, as the tunnel end forwards to it.
#[async_trait]
pub trait SpokeApi: Send + Sync + 'static {
    /// Sends `request` (origin-form URI: path and query) with the agent's credentials and
    /// returns the response as it starts, its body streaming.
    async fn send(
        &self,
        request: http::Request<TunnelBody>,
    ) -> Result<http::Response<TunnelBody>, SpokeError>;
}

/// Why a request did not reach the spoke's apiserver. Retryable: the apiserver may come back.
#[derive(Debug, thiserror::Error)]
#[error("cannot reach the spoke apiserver {server}: {detail}")]
pub struct SpokeError {
    pub server: String,
    pub detail: String,
}

/// How long a connection to the spoke apiserver may take to open.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle connections kept to the spoke apiserver for the next requests.
pub const IDLE_CONNECTIONS: usize = 32;

type Service = tower::util::BoxCloneSyncService<
    http::Request<TunnelBody>,
    http::Response<hyper::body::Incoming>,
    BoxError,
>;

/// The spoke's apiserver as the agent's kubeconfig describes it: HTTP/1.1 (so upgrades work),
/// TLS with the kubeconfig's CA and client certificate, and its bearer token or exec
/// credentials added to every request. The connection pool is shared by all tunnels.
#[derive(Clone)]
pub struct KubeSpoke {
    server: String,
    service: Service,
}

impl KubeSpoke {
    /// A client for the apiserver of `config`. Its read timeout is not used: watches and
    /// `logs -f` stay open as long as the user keeps them.
    pub fn new(config: &kube::Config) -> Result<KubeSpoke, SpokeError> {
        let server = config.cluster_url.to_string();
        let fail = |detail: String| SpokeError {
            server: server.clone(),
            detail,
        };
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        http.set_nodelay(true);
        let connector = config
            .rustls_https_connector_with_connector(http)
            .map_err(|e| fail(e.to_string()))?;
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_max_idle_per_host(IDLE_CONNECTIONS)
                .build::<_, TunnelBody>(connector);
        let auth = config.auth_layer().map_err(|e| fail(e.to_string()))?;
        let service = tower::ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .option_layer(auth)
            .service(client.map_err(BoxError::from))
            .map_err(BoxError::from);
        Ok(KubeSpoke {
            server,
            service: Service::new(service),
        })
    }
}

#[async_trait]
impl SpokeApi for KubeSpoke {
    async fn send(
        &self,
        request: http::Request<TunnelBody>,
    ) -> Result<http::Response<TunnelBody>, SpokeError> {
        // Made outside the await: the boxed service's future is 'static and Send.
        let sending: futures::future::BoxFuture<'static, _> =
            Box::pin(self.service.clone().oneshot(request));
        let response = sending.await.map_err(|e| SpokeError {
            server: self.server.clone(),
            detail: flotilla_ops::error_chain(&*e),
        })?;
        Ok(response.map(|body| body.map_err(BoxError::from).boxed()))
    }
}

/// An in-process stand-in for a spoke apiserver, for the load test's simulated clusters (which
/// have no HTTP endpoint): `GET /version`, any other `GET` of a `.../configmaps` collection
/// answers a ConfigMapList of `list_items` objects of about 1 KiB, and any other `GET` one small
/// object. Everything else is 405. It answers as an apiserver would, so what the tunnel adds is
/// what a measurement through it sees.
#[derive(Clone, Debug)]
pub struct SimulatedApi {
    /// The list body, made once: the responder's own cost stays out of the measurement.
    list: Bytes,
}

impl SimulatedApi {
    /// A responder whose collections hold `list_items` objects.
    pub fn new(list_items: usize) -> SimulatedApi {
        let items: Vec<serde_json::Value> = (0..list_items)
            .map(|i| {
                serde_json::json!({
                    "metadata": {"name": format!("config-{i:06}"), "namespace": "default",
                                 "resourceVersion": (i + 1).to_string()},
                    "data": {"payload": "x".repeat(900)},
                })
            })
            .collect();
        let list = serde_json::json!({
            "kind": "ConfigMapList", "apiVersion": "v1",
            "metadata": {"resourceVersion": list_items.to_string()},
            "items": items,
        });
        SimulatedApi {
            list: Bytes::from(serde_json::to_vec(&list).expect("a list serializes")),
        }
    }
}

#[async_trait]
impl SpokeApi for SimulatedApi {
    async fn send(
        &self,
        request: http::Request<TunnelBody>,
    ) -> Result<http::Response<TunnelBody>, SpokeError> {
        let path = request.uri().path();
        let (status, body) = if request.method() != http::Method::GET {
            (
                http::StatusCode::METHOD_NOT_ALLOWED,
                Bytes::from(flotilla_proto::tunnel::status_body(
                    405,
                    "MethodNotAllowed",
                    "the simulated cluster answers GET only",
                )),
            )
        } else if path == "/version" {
            (
                http::StatusCode::OK,
                Bytes::from_static(br#"{"major":"1","minor":"33","gitVersion":"v1.33.0-sim"}"#),
            )
        } else if path.ends_with("/configmaps") {
            (http::StatusCode::OK, self.list.clone())
        } else {
            let name = path.rsplit('/').next().unwrap_or_default();
            let object = serde_json::json!({
                "kind": "Namespace", "apiVersion": "v1",
                "metadata": {"name": name, "resourceVersion": "1"},
                "status": {"phase": "Active"},
            });
            (
                http::StatusCode::OK,
                Bytes::from(serde_json::to_vec(&object).expect("an object serializes")),
            )
        };
        let mut response = http::Response::new(
            http_body_util::Full::new(body)
                .map_err(|never| match never {})
                .boxed(),
        );
        *response.status_mut() = status;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        Ok(response)
    }
}
