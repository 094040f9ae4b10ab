//! `flotilla dashboard`: the hub's fleet status page in a browser on the operator's machine.
//! A browser does not hold the operator's client certificate, so, as `kubectl proxy` does,
//! the CLI listens on loopback and forwards each request for the page (`/ui/...`) to the hub's
//! operator API with the operator's certificate. The page stays behind the operator API's
//! authentication; the dashboard only carries it to the operator's own browser.
//!
//! Whoever can reach the dashboard acts as the operator, so it listens on loopback only,
//! answers only requests addressed to `localhost` (a page elsewhere cannot reach it by DNS
//! rebinding), forwards only `GET`/`HEAD` of `/ui` paths, and the hub's page is read-only.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use tokio::net::TcpListener;

use crate::client::OperatorClient;

/// `--port`'s default, kubectl proxy's.
pub const DEFAULT_PORT: u16 = 8001;

/// Why the dashboard cannot start.
#[derive(Debug, thiserror::Error)]
pub enum DashboardError {
    /// The operator asked for an address others can reach; not retryable: pick a loopback one.
    #[error(
        "--address {0}: the dashboard forwards with the operator's certificate, so anyone who \
         reaches it is the operator; it listens on loopback only (127.0.0.1 or ::1)"
    )]
    NotLoopback(std::net::IpAddr),
    /// The port is taken or not ours; retryable with another `--port`.
    #[error("cannot listen on {address} (--port): {source}")]
    Bind {
        address: SocketAddr,
        source: std::io::Error,
    },
    /// Serving stopped on an IO error; retryable by starting again.
    #[error("the dashboard stopped serving: {0}")]
    Serve(std::io::Error),
}

/// Binds the dashboard's listener on a loopback `address`.
pub async fn bind(address: SocketAddr) -> Result<TcpListener, DashboardError> {
    if !address.ip().is_loopback() {
        return Err(DashboardError::NotLoopback(address.ip()));
    }
    TcpListener::bind(address)
        .await
        .map_err(|source| DashboardError::Bind { address, source })
}

/// Serves the dashboard on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    client: Arc<OperatorClient>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), DashboardError> {
    let app = Router::new().fallback(forward).with_state(client);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(DashboardError::Serve)
}

/// Response headers of the hub's page that the browser must see as the hub sent them.
const FORWARDED_HEADERS: [header::HeaderName; 5] = [
    header::CONTENT_TYPE,
    header::CONTENT_SECURITY_POLICY,
    header::CACHE_CONTROL,
    header::X_CONTENT_TYPE_OPTIONS,
    header::LOCATION,
];

async fn forward(State(client): State<Arc<OperatorClient>>, request: Request) -> Response {
    if let Err(refusal) = check(&request) {
        return refusal;
    }
    let path = request.uri().path();
    if path == "/" {
        return Redirect::temporary("/ui/").into_response();
    }
    let path_and_query = request
        .uri()
        .path_and_query()
        .map_or(path, |p| p.as_str())
        .to_string();
    match client.get_raw(&path_and_query).await {
        Ok(answer) => {
            let mut response = Response::new(Body::from(answer.body().clone()));
            *response.status_mut() = answer.status();
            for name in FORWARDED_HEADERS {
                if let Some(value) = answer.headers().get(&name) {
                    response.headers_mut().insert(name, value.clone());
                }
            }
            response
        }
        Err(e) => refuse(
            StatusCode::BAD_GATEWAY,
            &format!("flotilla dashboard: the hub did not answer GET {path}: {e:#}"),
        ),
    }
}

/// What the dashboard refuses before anything reaches the hub.
#[allow(clippy::result_large_err)]
fn check(request: &Request) -> Result<(), Response> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return Err(refuse(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!(
                "flotilla dashboard is read-only: {} is not forwarded",
                request.method()
            ),
        ));
    }
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if !accepted_host(host) {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            &format!(
                "flotilla dashboard answers requests for localhost, 127.0.0.1 or [::1] only, \
                 not {host:?} (as kubectl proxy's --accept-hosts: a page on another site must \
                 not reach it by DNS rebinding)"
            ),
        ));
    }
    let path = request.uri().path();
    if path == "/" {
        return Ok(());
    }
    let dotted = path
        .split('/')
        .any(|segment| segment == "." || segment == ".." || segment.contains('%'));
    if !(path == "/ui" || path.starts_with("/ui/")) || dotted {
        return Err(refuse(
            StatusCode::NOT_FOUND,
            &format!("flotilla dashboard forwards the fleet status page (/ui/) only, not {path}"),
        ));
    }
    Ok(())
}

/// Whether a `Host` header names this machine's loopback (any port).
fn accepted_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().map(|h| format!("[{h}]")),
        None => host.split(':').next().map(str::to_string),
    };
    matches!(name.as_deref(), Some("localhost" | "127.0.0.1" | "[::1]"))
}

fn refuse(status: StatusCode, message: &str) -> Response {
    let mut response = (status, format!("{message}\n")).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: Method, host: &str, path: &str) -> Request {
        Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, host)
            .body(Body::empty())
            .unwrap()
    }

    #[test]
    fn only_reads_of_the_page_for_localhost_are_forwarded() {
        let check_status =
            |method: Method, host: &str, path: &str| match check(&request(method, host, path)) {
                Ok(()) => StatusCode::OK,
                Err(r) => r.status(),
            };
        assert_eq!(
            check_status(Method::GET, "localhost:8001", "/ui/"),
            StatusCode::OK
        );
        assert_eq!(
            check_status(Method::GET, "127.0.0.1:8001", "/ui/clusters?state=failing"),
            StatusCode::OK
        );
        assert_eq!(
            check_status(Method::HEAD, "[::1]:8001", "/ui"),
            StatusCode::OK
        );
        assert_eq!(check_status(Method::GET, "localhost", "/"), StatusCode::OK);
        assert_eq!(
            check_status(Method::POST, "localhost:8001", "/ui/"),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            check_status(Method::GET, "evil.example:8001", "/ui/"),
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            check_status(Method::GET, "localhost.evil.example", "/ui/"),
            StatusCode::FORBIDDEN
        );
        for path in [
            "/apis/cluster.open-cluster-management.io/v1/managedclusters",
            "/registration/v1/tokens",
            "/ui/../registration/v1/tokens",
            "/ui/%2e%2e/registration/v1/tokens",
            "/uix",
        ] {
            assert_eq!(
                check_status(Method::GET, "localhost:8001", path),
                StatusCode::NOT_FOUND,
                "{path}"
            );
        }
    }

    #[tokio::test]
    async fn it_listens_on_loopback_only() {
        let err = bind("0.0.0.0:0".parse().unwrap()).await.unwrap_err();
        assert!(err.to_string().contains("loopback only"), "{err}");
        assert!(bind("127.0.0.1:0".parse().unwrap()).await.is_ok());
    }
}
