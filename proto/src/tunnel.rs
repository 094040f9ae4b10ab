//! What travels inside a tunnel stream, and the rules both ends apply to it: one HTTP/1.1
//! request per stream, from the hub's proxy front to the agent, carrying the hub user's
//! identity as Kubernetes impersonation headers and nothing of the user's own credentials.
//!
//! The proxy front removes every credential and impersonation header the user sent
//! ([`strip_credentials`]) and sets the authenticated user's ([`set_identity`]); the agent
//! reads them back ([`identity`]), refuses a request without them (it would otherwise run
//! under the agent's own rights), refuses reserved `system:` identities, strips credentials
//! again, and forwards the request with its own. Both ends drop hop-by-hop headers
//! ([`remove_hop_by_hop`]) except an upgrade's, and both answer failures of their own as a
//! Kubernetes `Status` ([`status_body`]) so kubectl prints them as it prints the apiserver's.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::contract::RESERVED_IDENTITY_PREFIX;

/// The user a request runs as on the spoke (Kubernetes impersonation).
pub const IMPERSONATE_USER: HeaderName = HeaderName::from_static("impersonate-user");
/// One of the user's groups; repeated once per group.
pub const IMPERSONATE_GROUP: HeaderName = HeaderName::from_static("impersonate-group");
/// The tunnel's id, from the proxy front to the agent, so both ends' logs name the same request.
pub const TUNNEL_ID: HeaderName = HeaderName::from_static("x-flotilla-tunnel-id");

/// Headers whose name starts with this are impersonation (`Impersonate-User`,
/// `Impersonate-Group`, `Impersonate-Uid`, `Impersonate-Extra-*`).
const IMPERSONATE_PREFIX: &str = "impersonate-";

/// Removes whatever could make a request run as someone other than the hub says: the user's
/// `Authorization` (their bearer token for the hub), `Proxy-Authorization`, cookies, and every
/// `Impersonate-*` header they sent.
pub fn strip_credentials(headers: &mut HeaderMap) {
    headers.remove(header::AUTHORIZATION);
    headers.remove(header::PROXY_AUTHORIZATION);
    headers.remove(header::COOKIE);
    let impersonation: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with(IMPERSONATE_PREFIX))
        .cloned()
        .collect();
    for name in impersonation {
        headers.remove(name);
    }
}

/// Sets the hub user's identity on a request whose credentials were stripped. Names were
/// checked when the user was created ([`crate::contract::check_user_identity`]); a name that
/// is not a valid header value is an error naming it.
pub fn set_identity(headers: &mut HeaderMap, user: &str, groups: &[String]) -> Result<(), String> {
    let value = |what: &str, v: &str| {
        HeaderValue::from_str(v)
            .map_err(|_| format!("{what} {v:?} cannot travel in an HTTP header"))
    };
    headers.insert(IMPERSONATE_USER, value("user", user)?);
    for group in groups {
        headers.append(IMPERSONATE_GROUP, value("group", group)?);
    }
    Ok(())
}

/// Why the agent refuses a tunnel request's identity. Not retryable: the hub sent something it
/// never should.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityRefusal {
    /// No `Impersonate-User`: forwarding it would run the request with the agent's own rights.
    #[error(
        "the request carries no Impersonate-User header; the agent never forwards a request under its own identity"
    )]
    Missing,
    /// A header value that is not text.
    #[error("an impersonation header is not valid text")]
    NotText,
    /// A `system:` user or group, which Kubernetes gives built-in rights.
    #[error("the agent does not impersonate the reserved identity {0:?}")]
    Reserved(String),
}

/// The hub user a tunnel request runs as: `Impersonate-User` and every `Impersonate-Group`.
pub fn identity(headers: &HeaderMap) -> Result<(String, Vec<String>), IdentityRefusal> {
    let text = |v: &HeaderValue| {
        v.to_str()
            .map(str::to_string)
            .map_err(|_| IdentityRefusal::NotText)
    };
    let user = text(
        headers
            .get(IMPERSONATE_USER)
            .ok_or(IdentityRefusal::Missing)?,
    )?;
    let groups = headers
        .get_all(IMPERSONATE_GROUP)
        .iter()
        .map(text)
        .collect::<Result<Vec<_>, _>>()?;
    for name in std::iter::once(&user).chain(&groups) {
        if name.is_empty() {
            return Err(IdentityRefusal::Missing);
        }
        if name.starts_with(RESERVED_IDENTITY_PREFIX) {
            return Err(IdentityRefusal::Reserved(name.clone()));
        }
    }
    Ok((user, groups))
}

/// Whether a request asks to switch protocols (WebSocket or SPDY: exec, attach, port-forward).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
}

/// Drops the hop-by-hop headers (RFC 9110 7.6.1) and those the `Connection` header names:
/// they describe one connection, not the request. An upgrade keeps `Connection: Upgrade` and
/// `Upgrade`, which the next hop needs to switch protocols.
pub fn remove_hop_by_hop(headers: &mut HeaderMap) {
    let upgrade = is_upgrade(headers);
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    for name in named {
        if !(upgrade && name == header::UPGRADE) {
            headers.remove(name);
        }
    }
    for name in [
        header::CONNECTION,
        header::PROXY_AUTHENTICATE,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
    if upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    } else {
        headers.remove(header::UPGRADE);
    }
}

/// A Kubernetes `Status` failure body (what the apiserver answers with), so kubectl shows the
/// message as `Error from server (<reason>): <message>`.
pub fn status_body(code: u16, reason: &str, message: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }))
    .expect("a Status serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_users_credentials_and_impersonation_never_pass() {
        let mut h = headers(&[
            ("authorization", "Bearer abc.secret"),
            ("impersonate-user", "system:admin"),
            ("Impersonate-Group", "system:masters"),
            ("impersonate-extra-scopes", "x"),
            ("impersonate-uid", "1"),
            ("accept", "application/json"),
        ]);
        strip_credentials(&mut h);
        set_identity(&mut h, "alice", &["ops".into(), "dev".into()]).unwrap();
        assert!(h.get("authorization").is_none());
        assert!(h.get("impersonate-extra-scopes").is_none());
        assert!(h.get("impersonate-uid").is_none());
        assert_eq!(
            identity(&h).unwrap(),
            (
                "alice".to_string(),
                vec!["ops".to_string(), "dev".to_string()]
            )
        );
        assert_eq!(h.get("accept").unwrap(), "application/json");
    }

    #[test]
    fn the_agent_refuses_requests_without_or_with_reserved_identities() {
        assert_eq!(
            identity(&headers(&[("accept", "x")])),
            Err(IdentityRefusal::Missing)
        );
        assert_eq!(
            identity(&headers(&[
                ("impersonate-user", "alice"),
                ("impersonate-group", "system:masters")
            ])),
            Err(IdentityRefusal::Reserved("system:masters".into()))
        );
        assert_eq!(
            identity(&headers(&[(
                "impersonate-user",
                "system:kube-controller-manager"
            )])),
            Err(IdentityRefusal::Reserved(
                "system:kube-controller-manager".into()
            ))
        );
    }

    #[test]
    fn hop_by_hop_headers_go_except_an_upgrades() {
        let mut h = headers(&[
            ("connection", "keep-alive, x-private"),
            ("keep-alive", "timeout=5"),
            ("x-private", "1"),
            ("upgrade", "websocket"),
            ("accept", "*/*"),
        ]);
        assert!(!is_upgrade(&h));
        remove_hop_by_hop(&mut h);
        assert!(h.get("keep-alive").is_none() && h.get("x-private").is_none());
        assert!(h.get("upgrade").is_none() && h.get("connection").is_none());

        let mut h = headers(&[
            ("connection", "Upgrade"),
            ("upgrade", "SPDY/3.1"),
            ("x-stream-protocol-version", "v4.channel.k8s.io"),
        ]);
        assert!(is_upgrade(&h));
        remove_hop_by_hop(&mut h);
        assert_eq!(h.get("upgrade").unwrap(), "SPDY/3.1");
        assert_eq!(h.get("connection").unwrap(), "Upgrade");
        assert_eq!(
            h.get("x-stream-protocol-version").unwrap(),
            "v4.channel.k8s.io"
        );
    }

    #[test]
    fn failures_read_as_kubernetes_status() {
        let body: serde_json::Value =
            serde_json::from_slice(&status_body(503, "ServiceUnavailable", "cluster x is away"))
                .unwrap();
        assert_eq!(body["kind"], "Status");
        assert_eq!(body["code"], 503);
        assert_eq!(body["message"], "cluster x is away");
    }
}
