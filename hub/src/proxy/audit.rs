//! The proxy front's audit: one JSON line per request, written by one task to the audit file
//! (`--proxy-audit-log`), never a token, a header value or a body.
//!
//! A line is written when its request is over: the response body ended (a watch or `logs -f`
//! when the user stops it) or the upgraded stream closed. Lines wait in a bounded queue; when
//! the writer is that far behind, a line is counted as lost and the loss logged, rather than
//! requests waiting on the disk.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;
use tokio::sync::mpsc;
use tracing::{error, warn};

/// Lines waiting for the writer at most.
pub const AUDIT_QUEUE: usize = 16 * 1024;

/// One request, as audited.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AuditLine {
    /// When the request arrived, RFC 3339 UTC.
    pub time: String,
    pub user: String,
    pub groups: Vec<String>,
    pub cluster: String,
    /// Kubernetes' verb for the request (`get`, `list`, `watch`, `create`, ...).
    pub verb: String,
    pub method: String,
    /// The path on the cluster (without `/clusters/NAME` and without the query).
    pub path: String,
    /// The status the user got.
    pub status: u16,
    /// Bytes of request body (and, upgraded, bytes the user sent).
    pub bytes_in: u64,
    /// Bytes of response body (and, upgraded, bytes the user received).
    pub bytes_out: u64,
    pub duration_ms: u64,
    pub tunnel: String,
    /// Why the hub answered itself (refusal, limit, no session), empty when the cluster did.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub refused: String,
}

/// Where request tasks hand their lines.
#[derive(Clone, Debug)]
pub struct AuditSink {
    lines: mpsc::Sender<AuditLine>,
}

impl AuditSink {
    /// Queues a line, never waiting.
    pub fn record(&self, line: AuditLine) {
        if let Err(e) = self.lines.try_send(line) {
            warn!(tunnel = %e.into_inner().tunnel, "audit line lost: the audit writer is behind");
        }
    }
}

/// Why the audit file cannot be written. Not retryable without operator action.
#[derive(Debug, thiserror::Error)]
#[error("cannot write the proxy audit log {path}: {source}")]
pub struct AuditError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Opens the audit file for appending and returns the sink and the writer, which runs until
/// `stop` and every sink are done, writing what is queued.
pub fn open(
    path: &Path,
) -> Result<(AuditSink, impl Future<Output = ()> + Send + use<>), AuditError> {
    let fail = |source| AuditError {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(fail)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(fail)?;
    let (tx, rx) = mpsc::channel(AUDIT_QUEUE);
    let path = path.to_path_buf();
    Ok((AuditSink { lines: tx }, write_lines(file, path, rx)))
}

async fn write_lines(file: std::fs::File, path: PathBuf, mut lines: mpsc::Receiver<AuditLine>) {
    let mut out = std::io::BufWriter::new(file);
    let mut batch = Vec::new();
    while lines.recv_many(&mut batch, 256).await > 0 {
        for line in batch.drain(..) {
            let mut text = serde_json::to_vec(&line).expect("an audit line serializes");
            text.push(b'\n');
            if let Err(e) = out.write_all(&text) {
                error!(path = %path.display(), error = %e, "cannot write the proxy audit log");
            }
        }
        // Lines reach the file as their requests finish, not when a buffer fills.
        if let Err(e) = out.flush() {
            error!(path = %path.display(), error = %e, "cannot write the proxy audit log");
        }
    }
}

/// A sink whose lines a test reads back.
#[cfg(test)]
pub fn in_memory() -> (AuditSink, mpsc::Receiver<AuditLine>) {
    let (tx, rx) = mpsc::channel(AUDIT_QUEUE);
    (AuditSink { lines: tx }, rx)
}

/// Kubernetes' verb for a request on `path` (cluster-relative, no query) with `query`:
/// `watch` for `?watch=true`, `list` for a collection's GET, `get` for an object's (and for
/// paths outside the resource API such as `/version`), `deletecollection` for a collection's
/// DELETE, and `create`, `update`, `patch`, `delete` by method.
pub fn verb(method: &http::Method, path: &str, query: Option<&str>) -> String {
    let watching = query.is_some_and(|q| {
        q.split('&')
            .any(|kv| kv == "watch=true" || kv == "watch=1" || kv == "watch")
    });
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    // After /api/v1 or /apis/GROUP/VERSION: [namespaces, NS,] RESOURCE [, NAME [, SUB]].
    let rest = match segments.as_slice() {
        ["api", _, rest @ ..] => Some(rest),
        ["apis", _, _, rest @ ..] => Some(rest),
        _ => None,
    };
    let collection = rest.is_some_and(|rest| match rest {
        ["namespaces", _, tail @ ..] if !tail.is_empty() => tail.len() == 1,
        _ => rest.len() == 1,
    });
    match *method {
        http::Method::GET | http::Method::HEAD if watching => "watch",
        http::Method::GET | http::Method::HEAD if collection => "list",
        http::Method::GET | http::Method::HEAD => "get",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE if collection => "deletecollection",
        http::Method::DELETE => "delete",
        _ => return method.as_str().to_ascii_lowercase(),
    }
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;

    fn check(method: Method, path: &str, query: Option<&str>, want: &str) {
        assert_eq!(
            verb(&method, path, query),
            want,
            "{method} {path}?{query:?}"
        );
    }

    #[test]
    fn verbs_follow_kubernetes() {
        check(Method::GET, "/api/v1/namespaces", None, "list");
        check(Method::GET, "/api/v1/namespaces/default", None, "get");
        check(
            Method::GET,
            "/api/v1/namespaces/default/configmaps",
            None,
            "list",
        );
        check(
            Method::GET,
            "/api/v1/namespaces/default/configmaps",
            Some("watch=true&resourceVersion=1"),
            "watch",
        );
        check(
            Method::GET,
            "/api/v1/namespaces/default/pods/web/log",
            Some("follow=true"),
            "get",
        );
        check(Method::GET, "/apis/apps/v1/deployments", None, "list");
        check(Method::GET, "/version", None, "get");
        check(
            Method::POST,
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            None,
            "create",
        );
        check(
            Method::PATCH,
            "/api/v1/namespaces/default/configmaps/a",
            None,
            "patch",
        );
        check(
            Method::DELETE,
            "/api/v1/namespaces/default/configmaps",
            None,
            "deletecollection",
        );
        check(
            Method::DELETE,
            "/api/v1/namespaces/default/configmaps/a",
            None,
            "delete",
        );
    }

    #[test]
    fn lines_are_json_without_an_empty_refusal() {
        let line = AuditLine {
            time: "2025-01-01T00:00:00Z".into(),
            user: "alice".into(),
            groups: vec!["ops".into()],
            cluster: "store-1".into(),
            verb: "list".into(),
            method: "GET".into(),
            path: "/api/v1/namespaces".into(),
            status: 200,
            bytes_in: 0,
            bytes_out: 812,
            duration_ms: 3,
            tunnel: "t-1".into(),
            refused: String::new(),
        };
        let v: serde_json::Value = serde_json::to_value(&line).unwrap();
        assert_eq!(v["bytesOut"], 812);
        assert_eq!(v["tunnel"], "t-1");
        assert!(v.get("refused").is_none());
    }
}
