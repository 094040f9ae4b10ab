//! `flotilla-agent join`: the spoke's half of OCM's double opt-in.
//!
//! The agent makes its key pair here (the private key never leaves the spoke), dials the hub
//! over TLS without a client certificate, and trusts the hub only if the chain it presents
//! contains the CA whose SHA-256 fingerprint the join command pins (as `kubeadm join
//! --discovery-token-ca-cert-hash` does). It sends a CSR with the bootstrap token and waits:
//! PENDING until an operator accepts, then ACCEPTED with the certificate, which it stores with
//! the key and the CA bundle; from then on it speaks mTLS only. DENIED ends the join with the
//! hub's reason. Connection failures are retried with backoff, with the same key, so the hub
//! re-attaches the agent to its recorded request.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use flotilla_proto::wire::registration_client::RegistrationClient;
use flotilla_proto::wire::{JoinRequest, join_update};
use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::Digest;
use tokio_rustls::TlsConnector;
use tonic::transport::Endpoint;
use tracing::{info, warn};

use crate::connect::DIAL_TIMEOUT;
use crate::identity::{Identity, IdentityError};
use flotilla_transport::dial::{self as proxy, ProxyUrl};

/// First delay between join attempts after a connection failure; doubles up to
/// [`JOIN_RETRY_MAX`].
pub const JOIN_RETRY_INITIAL: Duration = Duration::from_millis(500);
/// Longest delay between join attempts.
pub const JOIN_RETRY_MAX: Duration = Duration::from_secs(30);

/// A bootstrap token (`<id>.<secret>`). Never printed: `Debug` and `Display` show the id only.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapToken(String);

impl BootstrapToken {
    /// The public id part, for logs.
    pub fn id(&self) -> &str {
        self.0.split_once('.').map_or("<malformed>", |(id, _)| id)
    }

    fn secret(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for BootstrapToken {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.split_once('.')
            .is_some_and(|(id, secret)| !id.is_empty() && !secret.is_empty())
        {
            Ok(BootstrapToken(s.trim().to_string()))
        } else {
            Err("expected <id>.<secret> as printed by `flotilla token create`".into())
        }
    }
}

impl fmt::Debug for BootstrapToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BootstrapToken({}.<redacted>)", self.id())
    }
}

/// Everything a join needs.
#[derive(Debug, Clone)]
pub struct JoinParams {
    /// host:port of the hub's agent listener.
    pub hub: String,
    /// Name checked against the hub's serving certificate.
    pub server_name: String,
    pub cluster_name: String,
    pub token: BootstrapToken,
    /// Hex SHA-256 of the hub CA certificate (DER), from the join command.
    pub ca_fingerprint: String,
    /// `k=v` labels the agent asks for (the hub may add its own).
    pub labels: Vec<String>,
    pub proxy: Option<ProxyUrl>,
    /// Source address to dial from (see `Dialer::with_local_address`).
    pub local_address: Option<IpAddr>,
}

/// Why a join ended without a certificate.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The hub refused (bad or used-up token, name taken, denied). Not retryable: the message
    /// says what to fix.
    #[error("the hub refused the join: {0}")]
    Denied(String),
    /// The hub's chain has no CA with the pinned fingerprint. Not retryable: the join command's
    /// --ca-fingerprint is wrong, or this is not the hub.
    #[error(
        "the hub at {hub} presented no CA with fingerprint {pin}: check --ca-fingerprint against \
         `flotilla ca show` on the hub (or something other than the hub answered)"
    )]
    WrongCaPin { hub: String, pin: String },
    /// The --ca-fingerprint is not a hex SHA-256. Not retryable.
    #[error("--ca-fingerprint {0:?} is not a hex SHA-256 (64 hex digits)")]
    BadPin(String),
    /// The identity could not be stored. Retryable once the disk is fixed.
    #[error("{0}")]
    Identity(#[from] IdentityError),
    /// The agent is shutting down.
    #[error("join interrupted by shutdown")]
    Shutdown,
}

/// Joins, retrying connection failures, until ACCEPTED (identity stored), DENIED, a wrong pin
/// or `shutdown`.
pub async fn join(
    params: &JoinParams,
    identity: &Identity,
    shutdown: impl Future<Output = ()>,
) -> Result<(), JoinError> {
    let pin = parse_pin(&params.ca_fingerprint)?;
    let csr_pem = identity.join_request(&params.cluster_name)?;
    tokio::pin!(shutdown);
    let mut delay = JOIN_RETRY_INITIAL;
    loop {
        let pin_failed = Arc::new(AtomicBool::new(false));
        let attempt = attempt(params, &pin, &csr_pem, identity, pin_failed.clone());
        let outcome = tokio::select! {
            outcome = attempt => outcome,
            _ = &mut shutdown => return Err(JoinError::Shutdown),
        };
        match outcome {
            Ok(()) => return Ok(()),
            Err(Attempt::Final(e)) => return Err(e),
            Err(Attempt::Retry(_)) if pin_failed.load(Ordering::Relaxed) => {
                return Err(JoinError::WrongCaPin {
                    hub: params.hub.clone(),
                    pin: params.ca_fingerprint.clone(),
                });
            }
            Err(Attempt::Retry(reason)) => {
                warn!(hub = %params.hub, %reason, retry_in = ?delay, "join attempt failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = &mut shutdown => return Err(JoinError::Shutdown),
                }
                delay = (delay * 2).min(JOIN_RETRY_MAX);
            }
        }
    }
}

enum Attempt {
    Final(JoinError),
    Retry(String),
}

async fn attempt(
    params: &JoinParams,
    pin: &[u8; 32],
    csr_pem: &str,
    identity: &Identity,
    pin_failed: Arc<AtomicBool>,
) -> Result<(), Attempt> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = Arc::new(PinnedCa {
        pin: *pin,
        provider: provider.clone(),
        failed: pin_failed,
    });
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Attempt::Retry(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let connector = TlsConnector::from(Arc::new(tls));
    let server_name = ServerName::try_from(params.server_name.clone())
        .map_err(|e| Attempt::Final(JoinError::Denied(format!("--server-name: {e}"))))?;
    let hub = params.hub.clone();
    let proxy = params.proxy.clone();
    let local = params.local_address;
    let dial = tower::service_fn(move |_uri: http::Uri| {
        let (connector, server_name, hub, proxy) = (
            connector.clone(),
            server_name.clone(),
            hub.clone(),
            proxy.clone(),
        );
        async move {
            let tcp = proxy::dial(&hub, proxy.as_ref(), local).await?;
            // A gateway over its rate says so before TLS: the attempt fails saying it.
            let tcp = flotilla_transport::turn_away::Sniffed::new(tcp);
            let tls = connector.connect(server_name, tcp).await?;
            Ok::<_, std::io::Error>(TokioIo::new(tls))
        }
    });
    let endpoint = Endpoint::from_shared(format!("http://{}", params.hub))
        .map_err(|e| Attempt::Final(JoinError::Denied(format!("--hub {}: {e}", params.hub))))?;
    let channel = tokio::time::timeout(DIAL_TIMEOUT, endpoint.connect_with_connector(dial))
        .await
        .map_err(|_| {
            Attempt::Retry(format!(
                "connecting to the hub at {}: no answer within {DIAL_TIMEOUT:?}",
                params.hub
            ))
        })?
        .map_err(|e| Attempt::Retry(format!("connecting to the hub at {}: {e:?}", params.hub)))?;
    let request = JoinRequest {
        cluster_name: params.cluster_name.clone(),
        token: params.token.secret().to_string(),
        csr_pem: csr_pem.to_string(),
        labels: params.labels.clone(),
    };
    info!(hub = %params.hub, cluster = %params.cluster_name, token = %params.token.id(), "asking the hub to join");
    let mut updates = RegistrationClient::new(channel)
        .join(request)
        .await
        .map_err(|s| Attempt::Retry(format!("{} ({:?})", s.message(), s.code())))?
        .into_inner();
    let mut told_pending = false;
    loop {
        let update = match updates.message().await {
            Ok(Some(u)) => u,
            Ok(None) => return Err(Attempt::Retry("the hub ended the join stream".into())),
            Err(s) => return Err(Attempt::Retry(format!("{} ({:?})", s.message(), s.code()))),
        };
        match join_update::State::try_from(update.state) {
            Ok(join_update::State::Pending) => {
                if !told_pending {
                    info!(message = %update.message, "join request pending on the hub");
                    told_pending = true;
                }
            }
            Ok(join_update::State::Accepted) => {
                identity
                    .complete_join(&update.certificate_pem, &update.ca_bundle_pem)
                    .map_err(|e| Attempt::Final(e.into()))?;
                info!(dir = %identity.dir().display(), "joined: certificate stored; using mTLS from now on");
                return Ok(());
            }
            Ok(join_update::State::Denied) => {
                return Err(Attempt::Final(JoinError::Denied(update.message)));
            }
            Ok(join_update::State::Unspecified) | Err(_) => {
                return Err(Attempt::Retry(format!(
                    "unknown join state {} from the hub",
                    update.state
                )));
            }
        }
    }
}

fn parse_pin(hex_pin: &str) -> Result<[u8; 32], JoinError> {
    let bad = || JoinError::BadPin(hex_pin.to_string());
    let bytes = hex::decode(hex_pin.trim().trim_start_matches("sha256:")).map_err(|_| bad())?;
    bytes.try_into().map_err(|_| bad())
}

/// Trusts the hub's chain only through the CA whose fingerprint the join command pins: that CA
/// must be among the certificates the hub presents, and the serving certificate must chain to
/// it and name the hub.
#[derive(Debug)]
struct PinnedCa {
    pin: [u8; 32],
    provider: Arc<rustls::crypto::CryptoProvider>,
    /// Set when the chain held no pinned CA, so the join stops rather than retries.
    failed: Arc<AtomicBool>,
}

impl ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(ca) = intermediates
            .iter()
            .find(|c| sha2::Sha256::digest(c.as_ref()).as_slice() == self.pin)
        else {
            self.failed.store(true, Ordering::Relaxed);
            return Err(rustls::Error::General(
                "the hub presented no CA with the pinned fingerprint".into(),
            ));
        };
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone().into_owned())?;
        let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            self.provider.clone(),
        )
        .build()
        .map_err(|e| rustls::Error::General(e.to_string()))?;
        webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_never_print_their_secret() {
        let token: BootstrapToken = "abc123.s3cr3tpart".parse().unwrap();
        assert_eq!(token.id(), "abc123");
        assert!(!format!("{token:?}").contains("s3cr3t"));
        assert!("no-dot".parse::<BootstrapToken>().is_err());
    }

    #[test]
    fn pins_are_hex_sha256() {
        assert!(parse_pin(&"ab".repeat(32)).is_ok());
        assert!(parse_pin(&format!("sha256:{}", "ab".repeat(32))).is_ok());
        assert!(matches!(parse_pin("abc"), Err(JoinError::BadPin(_))));
    }
}
