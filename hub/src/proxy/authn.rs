//! Who a proxy request is from: a client certificate the hub issued to a kubectl user
//! (`flotilla user create`: `CN=<user>, O=flotilla:users, OU=<groups, comma-separated>`), or a bearer token from
//! the tokens file (`--proxy-token-file`), in kube-apiserver's `--token-auth-file` format:
//! `token,user,uid,"group1,group2"` per line (uid ignored, groups optional, `#` comments).
//!
//! Tokens are kept only as SHA-256 hashes in memory and never logged. Operator and cluster
//! certificates are not proxy users: an operator administers the fleet, a kubectl user reaches
//! clusters, and one never stands in for the other.

use std::collections::HashMap;
use std::path::Path;

use flotilla_proto::contract::check_user_identity;
use flotilla_transport::identity::Peer;
use http::HeaderMap;
use sha2::{Digest as _, Sha256};

/// An authenticated proxy user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyUser {
    pub user: String,
    pub groups: Vec<String>,
}

/// The bearer tokens the proxy front accepts, by SHA-256 of the token.
#[derive(Debug, Default)]
pub struct ProxyTokens {
    by_hash: HashMap<[u8; 32], ProxyUser>,
}

/// Why a request is not authenticated (401), in words for the user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthnError {
    #[error(
        "the proxy front needs a user certificate (flotilla user create) or a bearer token; this request has neither"
    )]
    Anonymous,
    #[error("the bearer token is not known to the hub")]
    UnknownToken,
    #[error(
        "{0} is not a kubectl user of the proxy front; use a certificate from `flotilla user create` or a bearer token"
    )]
    NotAUser(String),
}

/// Why the tokens file cannot be used. Not retryable: fix the file and restart the hub.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("cannot read the proxy tokens file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("proxy tokens file {path}, line {line}: {detail}")]
    Invalid {
        path: String,
        line: usize,
        detail: String,
    },
}

impl ProxyTokens {
    /// Reads the tokens file.
    pub fn load(path: &Path) -> Result<ProxyTokens, TokensError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TokensError::Read {
            path: shown.clone(),
            source,
        })?;
        ProxyTokens::parse(&text).map_err(|(line, detail)| TokensError::Invalid {
            path: shown,
            line,
            detail,
        })
    }

    /// Parses the CSV lines; an error names the line (never the token).
    pub fn parse(text: &str) -> Result<ProxyTokens, (usize, String)> {
        let mut tokens = ProxyTokens::default();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fail = |detail: String| (i + 1, detail);
            // The groups column may be quoted and hold commas.
            let (head, groups) = match line.find('"') {
                Some(q) => {
                    let rest = &line[q + 1..];
                    let end = rest
                        .find('"')
                        .ok_or_else(|| fail("the groups column has no closing quote".into()))?;
                    (line[..q].trim_end_matches(','), &rest[..end])
                }
                None => (line, ""),
            };
            let mut columns = head.split(',').map(str::trim);
            let token = columns.next().unwrap_or_default();
            let user = columns.next().unwrap_or_default();
            let _uid = columns.next();
            let mut group_list: Vec<String> = columns
                .chain(groups.split(','))
                .map(str::trim)
                .filter(|g| !g.is_empty())
                .map(str::to_string)
                .collect();
            group_list.dedup();
            if token.len() < 16 {
                return Err(fail(
                    "the token is shorter than 16 characters; use a random one (e.g. openssl rand -hex 32)".into(),
                ));
            }
            check_user_identity("user", user).map_err(fail)?;
            for g in &group_list {
                check_user_identity("group", g).map_err(fail)?;
            }
            let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
            if tokens
                .by_hash
                .insert(
                    hash,
                    ProxyUser {
                        user: user.to_string(),
                        groups: group_list,
                    },
                )
                .is_some()
            {
                return Err(fail("this token is listed twice".into()));
            }
        }
        Ok(tokens)
    }

    /// The request's user: its certificate's, or its bearer token's when it has no certificate.
    pub fn authenticate(&self, peer: &Peer, headers: &HeaderMap) -> Result<ProxyUser, AuthnError> {
        match peer {
            Peer::User { user, groups } => Ok(ProxyUser {
                user: user.clone(),
                groups: groups.clone(),
            }),
            Peer::Operator { user, .. } => Err(AuthnError::NotAUser(format!("operator {user}"))),
            Peer::Cluster(name) => Err(AuthnError::NotAUser(format!("cluster {name}"))),
            Peer::Gateway { name } => Err(AuthnError::NotAUser(format!("gateway {name}"))),
            Peer::Anonymous => {
                let token = headers
                    .get(http::header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
                    .map(str::trim)
                    .ok_or(AuthnError::Anonymous)?;
                let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
                self.by_hash
                    .get(&hash)
                    .cloned()
                    .ok_or(AuthnError::UnknownToken)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn tokens_and_certificates_name_the_user() {
        let tokens = ProxyTokens::parse(
            "# ops\n0123456789abcdef0123,carol,1001,\"ops,dev\"\nfedcba9876543210fedc,dave\n",
        )
        .unwrap();
        assert_eq!(
            tokens.authenticate(&Peer::Anonymous, &bearer("0123456789abcdef0123")),
            Ok(ProxyUser {
                user: "carol".into(),
                groups: vec!["ops".into(), "dev".into()]
            })
        );
        assert_eq!(
            tokens
                .authenticate(&Peer::Anonymous, &bearer("fedcba9876543210fedc"))
                .unwrap()
                .groups,
            Vec::<String>::new()
        );
        assert_eq!(
            tokens.authenticate(&Peer::Anonymous, &bearer("nope-nope-nope-nope")),
            Err(AuthnError::UnknownToken)
        );
        assert_eq!(
            tokens.authenticate(&Peer::Anonymous, &HeaderMap::new()),
            Err(AuthnError::Anonymous)
        );
        let alice = Peer::User {
            user: "alice".into(),
            groups: vec!["ops".into()],
        };
        // A certificate wins over any token the request also carries.
        assert_eq!(
            tokens
                .authenticate(&alice, &bearer("0123456789abcdef0123"))
                .unwrap()
                .user,
            "alice"
        );
        let operator = Peer::Operator {
            user: "admin".into(),
            groups: vec![],
        };
        assert!(matches!(
            tokens.authenticate(&operator, &HeaderMap::new()),
            Err(AuthnError::NotAUser(_))
        ));
    }

    #[test]
    fn bad_lines_are_named_without_the_token() {
        for (text, want) in [
            ("short,carol", "line 1: the token is shorter"),
            (
                "\n0123456789abcdef0123,system:admin",
                "line 2: user \"system:admin\" is reserved",
            ),
            (
                "0123456789abcdef0123,carol,1,\"system:masters\"",
                "is reserved",
            ),
            (
                "0123456789abcdef0123,a\n0123456789abcdef0123,b",
                "line 2: this token is listed twice",
            ),
        ] {
            let (line, detail) = ProxyTokens::parse(text).unwrap_err();
            let got = format!("line {line}: {detail}");
            assert!(got.contains(want), "{text}: {got}");
            assert!(!got.contains("0123456789abcdef"), "{got}");
        }
    }
}
