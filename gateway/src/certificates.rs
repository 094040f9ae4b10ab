//! Certificate rotation as the gateway sees it: it answers an agent's `RenewCertificate` over
//! the live session, but the CA key is not its to hold. The hub, which holds it, implements
//! [`ClusterCertificates`]; a gateway without one refuses renewals (and agents keep their
//! current certificate until one that can answers).

use async_trait::async_trait;

/// A certificate the hub signed for a session's cluster.
#[derive(Clone)]
pub struct RenewedCertificate {
    /// PEM client certificate for the key of the request.
    pub certificate_pem: String,
    /// PEM CA certificates the agent should trust for the hub from now on.
    pub ca_bundle_pem: String,
}

impl std::fmt::Debug for RenewedCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Certificates are public, but long; logs want to know that one was issued, not its PEM.
        f.debug_struct("RenewedCertificate").finish_non_exhaustive()
    }
}

/// Why a renewal was refused; the agent keeps its current certificate either way.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RenewalError {
    /// The request itself is unusable (does not parse, bad signature, unsupported key). Not
    /// retryable with the same request; the agent makes a new key and request.
    #[error("certificate signing request refused: {0}")]
    BadRequest(String),
    /// The cluster may no longer hold a certificate (denied, deleted, key unregistered). Not
    /// retryable until an operator acts; the session is being closed anyway.
    #[error("cluster {cluster} may not renew: {reason}")]
    NotAdmitted { cluster: String, reason: String },
    /// The hub could not record the new key or sign (store unavailable, conflict storm).
    /// Retryable: the agent asks again later.
    #[error("the hub could not issue a certificate now: {0}; the agent will retry")]
    Unavailable(String),
}

/// The hub's certificate authority, as the gateway needs it.
#[async_trait]
pub trait ClusterCertificates: Send + Sync + 'static {
    /// Signs `csr_pem` for `cluster` (the session's certificate identity; the request's own
    /// subject is ignored), after registering the request's key as the cluster's newest key
    /// next to `current_key_sha256` (the key of the session asking).
    async fn renew(
        &self,
        cluster: &str,
        current_key_sha256: &str,
        csr_pem: &str,
    ) -> Result<RenewedCertificate, RenewalError>;

    /// The CA bundle agents should trust for the hub now (PEM, old and new CA during a
    /// rotation's overlap).
    fn ca_bundle(&self) -> String;
}
