//! Why the agent has no session, in the words a spoke's operator needs: what happened and what
//! to do. Every way a dial or a session can fail (the hub unreachable, a proxy in the way, a
//! certificate refused by either side, the hub's admission refusals) becomes one [`Refusal`]
//! whose `Display` is the log line; the load test counts them by [`RefusalKind`].

use std::fmt;

use flotilla_proto::session::CloseReason;
use flotilla_proto::wire;
use flotilla_transport::LinkError;

/// TLS alert numbers (RFC 8446, 6.2) the agent tells apart.
mod alert {
    pub const BAD_CERTIFICATE: u8 = 42;
    pub const CERTIFICATE_REVOKED: u8 = 44;
    pub const CERTIFICATE_EXPIRED: u8 = 45;
    pub const CERTIFICATE_UNKNOWN: u8 = 46;
    pub const UNKNOWN_CA: u8 = 48;
    pub const DECRYPT_ERROR: u8 = 51;
}

/// The kinds of [`Refusal`], each with its own advice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefusalKind {
    /// Nothing answers at the hub's address (refused, no route, no such host).
    HubUnreachable,
    /// The hub (or the network) did not answer in time.
    HubTimedOut,
    /// The HTTP proxy refused to connect the agent to the hub.
    ProxyRefused,
    /// The HTTP proxy itself cannot be reached.
    ProxyUnreachable,
    /// The hub refused this agent's certificate: not issued by the hub's CA.
    CertificateNotTrusted,
    /// The hub refused this agent's certificate: expired.
    CertificateExpired,
    /// The agent refused the hub's certificate (not from the CA it trusts, or wrong name).
    HubNotTrusted,
    /// Admission: no such cluster on the hub (never joined, or deleted).
    ClusterNotRegistered,
    /// Admission: an operator denied the cluster.
    ClusterDenied,
    /// Admission: the cluster is not accepted (yet).
    ClusterNotAccepted,
    /// Admission: the certificate's key is not the cluster's (replaced by a rejoin, revoked).
    KeyNotRegistered,
    /// The hub does not take this certificate for a session (not an agent's).
    NotAnAgent,
    /// An established session ended (the hub went away, a heartbeat timeout, a protocol
    /// error); the agent reconnects.
    SessionLost,
    /// Anything else on the way to the hub.
    Other,
}

impl RefusalKind {
    /// Whether retrying without anyone acting can help (the agent retries either way, but
    /// logs the others as errors: someone must act).
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            RefusalKind::HubUnreachable
                | RefusalKind::HubTimedOut
                | RefusalKind::ProxyUnreachable
                | RefusalKind::SessionLost
                | RefusalKind::Other
        )
    }
}

/// Why the agent has no session, with the detail behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub kind: RefusalKind,
    /// The hub's `--hub` address, as the agent dials it.
    pub hub: String,
    /// The underlying error or the hub's own words.
    pub detail: String,
    /// The dial was over QUIC alone (`--transport quic`): a timeout may be UDP blocked on the
    /// way, which the other carriers would get through.
    pub over_quic: bool,
}

impl Refusal {
    /// A failed dial, or a session call that failed before the hub said anything.
    pub fn from_link(hub: &str, error: &LinkError) -> Refusal {
        let kind = match error {
            LinkError::Unreachable(_) => RefusalKind::HubUnreachable,
            LinkError::TimedOut(_) => RefusalKind::HubTimedOut,
            LinkError::Proxy { refused: true, .. } => RefusalKind::ProxyRefused,
            LinkError::Proxy { refused: false, .. } => RefusalKind::ProxyUnreachable,
            LinkError::Tls {
                alert: alert::CERTIFICATE_EXPIRED,
                by_peer: true,
                ..
            } => RefusalKind::CertificateExpired,
            LinkError::Tls {
                alert:
                    alert::UNKNOWN_CA
                    | alert::DECRYPT_ERROR
                    | alert::BAD_CERTIFICATE
                    | alert::CERTIFICATE_UNKNOWN
                    | alert::CERTIFICATE_REVOKED,
                by_peer: true,
                ..
            } => RefusalKind::CertificateNotTrusted,
            LinkError::Tls { by_peer: false, .. } => RefusalKind::HubNotTrusted,
            LinkError::Tls { .. } => RefusalKind::Other,
            // A dial turned away over the rate is a drain (see `driver`), no refusal; one met
            // elsewhere (joining) is retried as anything else.
            LinkError::TurnedAway { .. }
            | LinkError::TooLarge { .. }
            | LinkError::Malformed(_)
            | LinkError::Transport(_) => RefusalKind::Other,
        };
        Refusal {
            kind,
            hub: hub.to_string(),
            detail: error.to_string(),
            over_quic: false,
        }
    }

    /// The same refusal of a dial made over QUIC alone.
    pub fn over_quic(self) -> Refusal {
        Refusal {
            over_quic: true,
            ..self
        }
    }

    /// A session the hub ended, or one that ended on this side.
    pub fn from_close(hub: &str, reason: &CloseReason) -> Refusal {
        let kind = match reason {
            CloseReason::Refused { refusal, .. } => match refusal {
                wire::Refusal::ClusterNotRegistered => RefusalKind::ClusterNotRegistered,
                wire::Refusal::ClusterDenied => RefusalKind::ClusterDenied,
                wire::Refusal::ClusterNotAccepted => RefusalKind::ClusterNotAccepted,
                wire::Refusal::KeyNotRegistered => RefusalKind::KeyNotRegistered,
                wire::Refusal::NotAnAgent => RefusalKind::NotAnAgent,
                wire::Refusal::Unspecified => RefusalKind::Other,
            },
            _ => RefusalKind::SessionLost,
        };
        let detail = match reason {
            CloseReason::Refused { reason, .. } => reason.clone(),
            other => other.to_string(),
        };
        Refusal {
            kind,
            hub: hub.to_string(),
            detail,
            over_quic: false,
        }
    }

    /// What to do about it, for the log.
    pub fn advice(&self) -> &'static str {
        match self.kind {
            RefusalKind::HubUnreachable => {
                "check that the hub is running and that --hub names its agents' address, and \
                 that no firewall blocks the way out"
            }
            RefusalKind::HubTimedOut if self.over_quic => {
                "UDP to the hub may be blocked on the way (QUIC runs over UDP), or the network \
                 or the hub is slow or dropping packets: `--transport auto` falls back to gRPC \
                 over TCP when QUIC does not get through, `--transport grpc` uses TCP only; the \
                 agent keeps trying"
            }
            RefusalKind::HubTimedOut => {
                "the network or the hub is slow or dropping packets; the agent keeps trying"
            }
            RefusalKind::ProxyRefused => {
                "the proxy's rules must allow CONNECT to the hub's address and port from this \
                 host; check --proxy-url and the proxy's access list"
            }
            RefusalKind::ProxyUnreachable => {
                "check that the proxy in --proxy-url is running and reachable from this host"
            }
            RefusalKind::CertificateNotTrusted => {
                "this agent's certificate was not issued by this hub's CA (a certificate from \
                 another hub, or a hub rebuilt with a new CA): join again with a bootstrap token \
                 from this hub (`flotilla token create` on the hub, then `flotilla-agent join`)"
            }
            RefusalKind::CertificateExpired => {
                "this agent's certificate has expired (the agent was off longer than its \
                 lifetime, or renewal kept failing): join again with a new bootstrap token"
            }
            RefusalKind::HubNotTrusted => {
                "the hub's certificate is not signed by the CA this agent trusts (ca.crt in its \
                 identity directory) or does not name --server-name: check --hub and \
                 --server-name, or join again if the hub's CA was replaced"
            }
            RefusalKind::ClusterNotRegistered => {
                "the hub has no cluster of this name (never joined, or deleted): join again \
                 with a bootstrap token"
            }
            RefusalKind::ClusterDenied => {
                "an operator denied this cluster: ask them; to come back, an operator deletes \
                 it (`flotilla cluster delete`) and it joins again"
            }
            RefusalKind::ClusterNotAccepted => {
                "an operator must accept the cluster on the hub (`flotilla cluster accept`)"
            }
            RefusalKind::KeyNotRegistered => {
                "this certificate's key is no longer the cluster's (it joined again elsewhere, \
                 or was revoked): join again with a new bootstrap token"
            }
            RefusalKind::NotAnAgent => {
                "the certificate in the identity directory is not an agent certificate: join \
                 with `flotilla-agent join`"
            }
            RefusalKind::SessionLost => "the agent reconnects on its own",
            RefusalKind::Other => "the agent keeps trying",
        }
    }

    fn what(&self) -> String {
        let hub = &self.hub;
        match self.kind {
            RefusalKind::HubUnreachable => format!("cannot reach the hub at {hub}"),
            RefusalKind::HubTimedOut => format!("the hub at {hub} did not answer in time"),
            RefusalKind::ProxyRefused => format!("the proxy refused the way to the hub at {hub}"),
            RefusalKind::ProxyUnreachable => "cannot reach the HTTP proxy".to_string(),
            RefusalKind::CertificateNotTrusted => {
                format!("the hub at {hub} refused this agent's certificate")
            }
            RefusalKind::CertificateExpired => {
                format!("the hub at {hub} refused this agent's expired certificate")
            }
            RefusalKind::HubNotTrusted => {
                format!("the agent does not trust the certificate of the hub at {hub}")
            }
            RefusalKind::ClusterNotRegistered
            | RefusalKind::ClusterDenied
            | RefusalKind::ClusterNotAccepted
            | RefusalKind::KeyNotRegistered
            | RefusalKind::NotAnAgent => format!("the hub at {hub} refused the session"),
            RefusalKind::SessionLost => format!("the session with the hub at {hub} ended"),
            RefusalKind::Other => format!("no session with the hub at {hub}"),
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}); {}", self.what(), self.detail, self.advice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(alert: u8, by_peer: bool) -> LinkError {
        LinkError::Tls {
            alert,
            by_peer,
            detail: format!("alert {alert}"),
        }
    }

    #[test]
    fn each_failure_gets_its_kind_and_advice() {
        let check = |e: LinkError, kind: RefusalKind, words: &str| {
            let r = Refusal::from_link("hub:9443", &e);
            assert_eq!(r.kind, kind, "{e:?}");
            let line = r.to_string();
            assert!(line.contains(words), "{line}");
            assert!(line.contains("hub:9443") || kind == RefusalKind::ProxyUnreachable);
        };
        check(
            LinkError::Unreachable("connection refused".into()),
            RefusalKind::HubUnreachable,
            "check that the hub is running",
        );
        check(
            tls(48, true),
            RefusalKind::CertificateNotTrusted,
            "not issued by this hub's CA",
        );
        check(
            tls(51, true),
            RefusalKind::CertificateNotTrusted,
            "join again with a bootstrap token",
        );
        check(
            tls(45, true),
            RefusalKind::CertificateExpired,
            "has expired",
        );
        check(tls(48, false), RefusalKind::HubNotTrusted, "--server-name");
        check(
            LinkError::Proxy {
                refused: true,
                detail: "403".into(),
            },
            RefusalKind::ProxyRefused,
            "access list",
        );
    }

    #[test]
    fn a_quic_timeout_says_udp_may_be_blocked_and_which_transport_gets_through() {
        let timeout = || LinkError::TimedOut("no answer within 10s".into());
        let over_quic = Refusal::from_link("hub:9443", &timeout()).over_quic();
        assert_eq!(over_quic.kind, RefusalKind::HubTimedOut);
        let line = over_quic.to_string();
        assert!(line.contains("UDP to the hub may be blocked"), "{line}");
        assert!(line.contains("--transport auto"), "{line}");
        assert!(line.contains("--transport grpc"), "{line}");
        let over_tcp = Refusal::from_link("hub:9443", &timeout()).to_string();
        assert!(!over_tcp.contains("UDP"), "{over_tcp}");
    }

    #[test]
    fn the_hubs_refusals_keep_its_words_and_add_what_to_do() {
        let r = Refusal::from_close(
            "hub:9443",
            &CloseReason::Refused {
                refusal: wire::Refusal::ClusterDenied,
                reason: "cluster store-7 was denied by the hub: stolen".into(),
            },
        );
        assert_eq!(r.kind, RefusalKind::ClusterDenied);
        let line = r.to_string();
        assert!(line.contains("denied by the hub: stolen"), "{line}");
        assert!(line.contains("ask them"), "{line}");
        assert!(!r.kind.is_retryable());
    }
}
