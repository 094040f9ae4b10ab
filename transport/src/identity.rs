//! Who is on the other end of a TLS connection, read from the client certificate.
//!
//! The hub CA issues four kinds of client certificates: agents get `CN=<cluster name>,
//! O=flotilla:clusters`, operators get `CN=<user>, O=flotilla:operators` (plus any extra groups
//! as further O values), and kubectl users of the proxy front get `CN=<user>, O=flotilla:users,
//! OU=<groups, comma-separated>`, and gateways (and the hub when it routes to them) get
//! `CN=<name>, O=flotilla:gateways`. The certificate is the only source of "which cluster is
//! this" and of "is this a gateway".
//!
//! A connection without a client certificate is [`Peer::Anonymous`]: the agents' listener lets
//! it through the handshake only so that a joining agent (which has no certificate yet) can
//! call `Registration.Join`; every other service refuses it.

use x509_parser::prelude::{FromDer, X509Certificate};

use flotilla_proto::contract::check_cluster_name;
pub use flotilla_proto::contract::{CLUSTER_GROUP, GATEWAY_GROUP, OPERATOR_GROUP, USER_GROUP};

/// The authenticated peer of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// An agent speaking for this managed cluster.
    Cluster(String),
    /// A person or tool using the operator API.
    Operator { user: String, groups: Vec<String> },
    /// A kubectl user of the proxy front (not an operator). `groups` are the certificate's OU,
    /// comma-separated.
    User { user: String, groups: Vec<String> },
    /// A gateway (or the hub routing to gateways): the only peer the relay hop serves.
    Gateway { name: String },
    /// No client certificate (a joining agent); allowed to call `Registration.Join` only.
    Anonymous,
}

/// Why a verified certificate still names no usable identity.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    /// The DER did not parse; not retryable with the same certificate.
    #[error("client certificate does not parse: {0}")]
    Malformed(String),
    /// No common name; not retryable with the same certificate.
    #[error("client certificate has no common name")]
    NoCommonName,
    /// Neither a cluster nor an operator certificate; not retryable.
    #[error(
        "client certificate for {cn:?} is in none of the groups {CLUSTER_GROUP}, {OPERATOR_GROUP}, {USER_GROUP} or {GATEWAY_GROUP}"
    )]
    UnknownGroup { cn: String },
    /// A cluster name that is not a DNS-1123 label; not retryable.
    #[error("client certificate's common name: {0}")]
    InvalidClusterName(flotilla_proto::contract::InvalidClusterName),
}

impl Peer {
    /// Reads the identity from a certificate that rustls has already verified against the CA.
    pub fn from_der(der: &[u8]) -> Result<Peer, IdentityError> {
        let (_, cert) =
            X509Certificate::from_der(der).map_err(|e| IdentityError::Malformed(e.to_string()))?;
        let subject = cert.subject();
        let cn = subject
            .iter_common_name()
            .next()
            .and_then(|a| a.as_str().ok())
            .ok_or(IdentityError::NoCommonName)?
            .to_string();
        let groups: Vec<String> = subject
            .iter_organization()
            .filter_map(|a| a.as_str().ok())
            .map(str::to_string)
            .collect();
        if groups.iter().any(|g| g == CLUSTER_GROUP) {
            check_cluster_name(&cn).map_err(IdentityError::InvalidClusterName)?;
            Ok(Peer::Cluster(cn))
        } else if groups.iter().any(|g| g == OPERATOR_GROUP) {
            Ok(Peer::Operator { user: cn, groups })
        } else if groups.iter().any(|g| g == USER_GROUP) {
            let groups = subject
                .iter_organizational_unit()
                .filter_map(|a| a.as_str().ok())
                .flat_map(|ou| ou.split(','))
                .filter(|g| !g.is_empty())
                .map(str::to_string)
                .collect();
            Ok(Peer::User { user: cn, groups })
        } else if groups.iter().any(|g| g == GATEWAY_GROUP) {
            Ok(Peer::Gateway { name: cn })
        } else {
            Err(IdentityError::UnknownGroup { cn })
        }
    }
}

/// Hex SHA-256 of a certificate's subject public key (the raw key bits of its
/// SubjectPublicKeyInfo): the key pin the hub records for a cluster at join and renewal, and
/// the gateway compares at every session. The same function of a CSR's key gives the same pin.
pub fn public_key_sha256(cert_der: &[u8]) -> Result<String, IdentityError> {
    use sha2::Digest;
    let (_, cert) =
        X509Certificate::from_der(cert_der).map_err(|e| IdentityError::Malformed(e.to_string()))?;
    Ok(hex::encode(sha2::Sha256::digest(
        &cert.public_key().subject_public_key.data,
    )))
}
