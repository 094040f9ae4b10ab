//! The hub's certificate authority: created on first start in the data dir, it signs the
//! gateways' serving certificates, the agents' client certificates (from the CSRs of keys the
//! agents made themselves) and the operators'.
//!
//! Rotation with overlap: [`Ca::rotate`] makes a new CA and keeps the old certificate as
//! `previous.crt` (its key is dropped: it signs nothing more), plus `cross.crt`, the new CA
//! signed by the old one. Agents trust the bundle (old + new) they receive over their session;
//! an agent that still trusts only the old CA verifies the new serving chain through the
//! cross-signed certificate, and client certificates from the old CA stay valid until they
//! are renewed. [`Ca::finish_rotation`] drops the old CA once every agent has renewed.

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_proto::contract::{
    CLUSTER_GROUP, GATEWAY_GROUP, OPERATOR_GROUP, USER_GROUP, check_user_identity,
};
use flotilla_transport::files::{Access, write_atomic};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, PublicKeyData,
    SanType,
};
use sha2::Digest;
use time::OffsetDateTime;

/// Lifetime of the CA created on first start.
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Default lifetime of agent certificates (renewed over the session before two thirds of it).
pub const DEFAULT_CLIENT_CERT_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);
/// Lifetime of gateway serving certificates; reissued on every hub start.
pub const SERVER_CERT_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);

/// Errors of the CA; none is retryable without operator action.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("CA file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error(
        "CA in {dir} is incomplete: {missing} is missing (restore it, or move the directory away to create a new CA, which invalidates every issued certificate)"
    )]
    Incomplete { dir: PathBuf, missing: &'static str },
    /// A certificate signing request (or the names it is for) is unusable; not retryable with
    /// the same request.
    #[error("certificate signing request: {0}")]
    BadRequest(String),
}

/// PEM certificate and key, as written to disk or sent to an agent.
#[derive(Clone)]
pub struct IssuedCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for IssuedCert {
    // Keys never reach logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedCert")
            .field("key_pem", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// The hub CA. `ca.crt` is public (agents pin its fingerprint); `ca.key` is the fleet's crown
/// jewel and is written with mode 0600.
pub struct Ca {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
    /// The CA before the last rotation, trusted (for client certificates it issued) until
    /// [`Ca::finish_rotation`].
    previous_pem: Option<String>,
    /// This CA signed by the previous one, so agents that trust only the previous CA verify
    /// the serving chain during the overlap.
    cross_pem: Option<String>,
}

/// File names in the CA directory.
const CA_CRT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
const PREVIOUS_CRT: &str = "previous.crt";
const CROSS_CRT: &str = "cross.crt";

impl Ca {
    /// Loads the CA from `dir`, creating it (and `dir`) on first start.
    pub fn load_or_create(dir: &Path) -> Result<Ca, CaError> {
        let cert_path = dir.join(CA_CRT);
        let key_path = dir.join(CA_KEY);
        match (cert_path.exists(), key_path.exists()) {
            (true, true) => {
                let cert_pem = read(&cert_path)?;
                let key = KeyPair::from_pem(&read(&key_path)?)?;
                let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)?;
                let optional = |name: &str| {
                    let path = dir.join(name);
                    path.exists().then(|| read(&path)).transpose()
                };
                Ok(Ca {
                    cert_pem,
                    issuer,
                    previous_pem: optional(PREVIOUS_CRT)?,
                    cross_pem: optional(CROSS_CRT)?,
                })
            }
            (false, false) => {
                fs::create_dir_all(dir).map_err(|source| CaError::Io {
                    path: dir.into(),
                    source,
                })?;
                let (ca, key_pem) = Ca::generate()?;
                write(&key_path, &key_pem, true)?;
                write(&cert_path, &ca.cert_pem, false)?;
                Ok(ca)
            }
            (true, false) => Err(CaError::Incomplete {
                dir: dir.into(),
                missing: "ca.key",
            }),
            (false, true) => Err(CaError::Incomplete {
                dir: dir.into(),
                missing: "ca.crt",
            }),
        }
    }

    /// A new CA, held in memory, and its key as PEM (written to disk before the CA signs
    /// anything that must outlive the process).
    pub(crate) fn generate() -> Result<(Ca, String), CaError> {
        // A name of its own, so a certificate from another hub's CA is refused as "unknown
        // CA" rather than as a bad signature from a namesake.
        let suffix: u32 = rand::random();
        let (params, key) = ca_params(&format!("flotilla hub CA {suffix:08x}"))?;
        let cert = params.self_signed(&key)?;
        let key_pem = key.serialize_pem();
        let ca = Ca {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
            previous_pem: None,
            cross_pem: None,
        };
        Ok((ca, key_pem))
    }

    /// The key the hub's QUIC listener derives its stateless-reset tokens from: derived from
    /// this CA's key, so a hub restarted on the same data dir resets its agents' old
    /// connections at their next packet (see `flotilla_transport::quic::ResetKey`).
    pub fn quic_reset_key(&self) -> flotilla_transport::quic::ResetKey {
        flotilla_transport::quic::ResetKey::derived_from(&self.issuer.key().serialize_der())
    }

    /// The keys of the agents' listener's session tickets: derived from this CA's key, so a
    /// hub restarted on the same data dir resumes its agents' sessions, and a CA rotation
    /// ends every earlier ticket (see `flotilla_transport::tickets`).
    pub fn ticket_keys(&self) -> flotilla_transport::tickets::TicketKeys {
        flotilla_transport::tickets::TicketKeys::derived_from(&self.issuer.key().serialize_der())
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA certificates agents and the client verifier trust: the current CA, and during a
    /// rotation's overlap the previous one.
    pub fn bundle_pem(&self) -> String {
        match &self.previous_pem {
            Some(previous) => format!("{}{}", self.cert_pem, previous),
            None => self.cert_pem.clone(),
        }
    }

    /// Whether a rotation's overlap is in progress (a previous CA is still trusted).
    pub fn rotating(&self) -> bool {
        self.previous_pem.is_some()
    }

    /// What the agents' listener presents: the serving certificate, then every CA certificate
    /// a client may need to reach the CA it trusts or pinned (the cross-signed certificate, the
    /// current CA, the previous CA). A joining agent looks in this chain for the CA whose
    /// fingerprint its join command pins.
    pub fn serving_chain_pem(&self, leaf_pem: &str) -> String {
        let mut chain = leaf_pem.to_string();
        for pem in [
            self.cross_pem.as_deref(),
            Some(self.cert_pem.as_str()),
            self.previous_pem.as_deref(),
        ]
        .into_iter()
        .flatten()
        {
            chain.push_str(pem);
        }
        chain
    }

    /// Makes a new CA in `dir`, keeping this one as the previous CA for the overlap and
    /// cross-signing the new one with it. Refused while an overlap is already in progress
    /// (finish it first), so that at most two CAs are ever trusted.
    pub fn rotate(&self, dir: &Path) -> Result<Ca, CaError> {
        if self.rotating() {
            return Err(CaError::BadRequest(
                "a CA rotation is already in progress: finish it first \
                 (`flotilla ca finish-rotation`, once every agent has renewed its certificate)"
                    .into(),
            ));
        }
        let stamp = OffsetDateTime::now_utc().unix_timestamp();
        let (params, key) = ca_params(&format!("flotilla hub CA {stamp}"))?;
        let cert = params.self_signed(&key)?;
        let cross = params.signed_by(&key, &self.issuer)?;
        write(&dir.join(PREVIOUS_CRT), &self.cert_pem, false)?;
        write(&dir.join(CROSS_CRT), &cross.pem(), false)?;
        write(&dir.join(CA_KEY), &key.serialize_pem(), true)?;
        write(&dir.join(CA_CRT), &cert.pem(), false)?;
        Ok(Ca {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
            previous_pem: Some(self.cert_pem.clone()),
            cross_pem: Some(cross.pem()),
        })
    }

    /// Ends a rotation's overlap: the previous CA is no longer trusted, and certificates it
    /// issued stop working. Run it after every agent renewed (one client-certificate lifetime
    /// after the rotation at the latest).
    pub fn finish_rotation(&self, dir: &Path) -> Result<Ca, CaError> {
        for name in [PREVIOUS_CRT, CROSS_CRT] {
            let path = dir.join(name);
            if path.exists() {
                fs::remove_file(&path).map_err(|source| CaError::Io { path, source })?;
            }
        }
        Ok(Ca {
            cert_pem: self.cert_pem.clone(),
            issuer: Issuer::from_ca_cert_pem(
                &self.cert_pem,
                KeyPair::from_pem(&self.issuer.key().serialize_pem())?,
            )?,
            previous_pem: None,
            cross_pem: None,
        })
    }

    /// Signs an agent's certificate signing request for managed cluster `cluster`. Only the
    /// request's key is used (its signature proves the agent holds the private key); subject,
    /// extensions and lifetime are the hub's. Returns the PEM certificate and the key's pin
    /// ([`csr_key_sha256`]).
    pub fn sign_cluster_csr(
        &self,
        cluster: &str,
        csr_pem: &str,
        lifetime: Duration,
    ) -> Result<(String, String), CaError> {
        let csr = parse_csr(csr_pem)?;
        let pin = hex::encode(sha2::Sha256::digest(csr.public_key.der_bytes()));
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(cluster, &[CLUSTER_GROUP]);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        validity(&mut params, lifetime);
        let cert = params.signed_by(&csr.public_key, &self.issuer)?;
        Ok((cert.pem(), pin))
    }

    /// A kubectl user's client certificate for the proxy front (`CN=<user>, O=flotilla:users,
    /// OU=<groups, comma-separated>`) for the key of `csr_pem`: the key stays where the user made it.
    /// Names are checked first ([`check_user_identity`]).
    pub fn sign_user_csr(
        &self,
        user: &str,
        groups: &[String],
        csr_pem: &str,
        lifetime: Duration,
    ) -> Result<String, CaError> {
        check_user_identity("user", user).map_err(CaError::BadRequest)?;
        for group in groups {
            check_user_identity("group", group).map_err(CaError::BadRequest)?;
            if [CLUSTER_GROUP, OPERATOR_GROUP, USER_GROUP, GATEWAY_GROUP].contains(&group.as_str())
            {
                return Err(CaError::BadRequest(format!(
                    "group {group:?} is flotilla's own; a kubectl user cannot be given it"
                )));
            }
        }
        let csr = parse_csr(csr_pem)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(user, &[USER_GROUP]);
        // One OU with every group: a subject holds one value per attribute type here, and
        // group names never contain commas (checked above).
        if !groups.is_empty() {
            params
                .distinguished_name
                .push(DnType::OrganizationalUnitName, groups.join(","));
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        validity(&mut params, lifetime);
        Ok(params.signed_by(&csr.public_key, &self.issuer)?.pem())
    }

    /// SHA-256 of the CA certificate (DER), hex: what a join command pins.
    pub fn fingerprint(&self) -> String {
        use rustls_pki_types::{CertificateDer, pem::PemObject};
        use sha2::Digest;
        let der = CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .expect("the CA certificate was parsed when the CA was loaded");
        hex::encode(sha2::Sha256::digest(der))
    }

    /// A serving certificate for the hub's own listeners (agents, operator API, proxy front),
    /// valid for `names` (DNS names or IP addresses clients dial).
    pub fn issue_server(&self, names: &[String]) -> Result<IssuedCert, CaError> {
        self.issue_serving(dn("flotilla gateway", &["flotilla"]), names, false)
    }

    /// A gateway's certificate (`CN=<name>, O=flotilla:gateways`): it serves agents at
    /// `names`, and as a client it opens the relay hop to the gateway holding a cluster's
    /// session, which serves only this group. The hub issues one for itself to route through
    /// the gateways in scale-out mode.
    pub fn issue_gateway(&self, name: &str, names: &[String]) -> Result<IssuedCert, CaError> {
        self.issue_serving(dn(name, &[GATEWAY_GROUP]), names, true)
    }

    fn issue_serving(
        &self,
        subject: DistinguishedName,
        names: &[String],
        client_too: bool,
    ) -> Result<IssuedCert, CaError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = subject;
        params.subject_alt_names = names
            .iter()
            .map(|n| match n.parse::<IpAddr>() {
                Ok(ip) => Ok(SanType::IpAddress(ip)),
                Err(_) => Ok(SanType::DnsName(n.clone().try_into()?)),
            })
            .collect::<Result<_, rcgen::Error>>()?;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        if client_too {
            params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ClientAuth);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        validity(&mut params, SERVER_CERT_LIFETIME);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(IssuedCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A client certificate for the agent of managed cluster `cluster`.
    pub fn issue_cluster(&self, cluster: &str, lifetime: Duration) -> Result<IssuedCert, CaError> {
        self.issue_client(cluster, &[CLUSTER_GROUP], lifetime)
    }

    /// Whether `cert_pem` was issued by this CA (not by the one before a rotation): its issuer
    /// is this CA's subject, and each CA's name is its own. `false` for anything unreadable.
    pub fn issued(&self, cert_pem: &str) -> bool {
        let der = |pem: &str| {
            x509_parser::pem::parse_x509_pem(pem.as_bytes())
                .ok()
                .map(|(_, p)| p.contents)
        };
        let (Some(cert), Some(ca)) = (der(cert_pem), der(&self.cert_pem)) else {
            return false;
        };
        match (
            x509_parser::parse_x509_certificate(&cert),
            x509_parser::parse_x509_certificate(&ca),
        ) {
            (Ok((_, cert)), Ok((_, ca))) => cert.issuer().as_raw() == ca.subject().as_raw(),
            _ => false,
        }
    }

    /// A client certificate for an operator (`flotilla` CLI user).
    pub fn issue_operator(&self, user: &str, lifetime: Duration) -> Result<IssuedCert, CaError> {
        self.issue_client(user, &[OPERATOR_GROUP], lifetime)
    }

    fn issue_client(
        &self,
        cn: &str,
        groups: &[&str],
        lifetime: Duration,
    ) -> Result<IssuedCert, CaError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(cn, groups);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        validity(&mut params, lifetime);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(IssuedCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// The key pin of a certificate signing request: hex SHA-256 of its raw public key, the same
/// value `flotilla_transport::identity::public_key_sha256` computes from a certificate for that
/// key. Verifies the request's signature.
pub fn csr_key_sha256(csr_pem: &str) -> Result<String, CaError> {
    let csr = parse_csr(csr_pem)?;
    Ok(hex::encode(sha2::Sha256::digest(
        csr.public_key.der_bytes(),
    )))
}

fn parse_csr(csr_pem: &str) -> Result<CertificateSigningRequestParams, CaError> {
    CertificateSigningRequestParams::from_pem(csr_pem).map_err(|e| {
        CaError::BadRequest(format!(
            "does not parse or its signature does not verify ({e}); the agent must send a PEM \
             PKCS#10 request signed by its new key"
        ))
    })
}

fn ca_params(cn: &str) -> Result<(CertificateParams, KeyPair), CaError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = dn(cn, &["flotilla"]);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, CA_LIFETIME);
    Ok((params, key))
}

fn dn(cn: &str, orgs: &[&str]) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    for o in orgs {
        dn.push(DnType::OrganizationName, *o);
    }
    dn
}

/// Most a certificate is back-dated.
const MAX_BACKDATE: Duration = Duration::from_secs(5 * 60);

fn validity(params: &mut CertificateParams, lifetime: Duration) {
    // Back-date a little: clocks of edge sites drift. Never by more than a tenth of the
    // lifetime, or a short-lived certificate would be past its renewal point when issued.
    let backdate = MAX_BACKDATE.min(lifetime / 10);
    let now = OffsetDateTime::now_utc();
    params.not_before = now - backdate;
    params.not_after = now + lifetime;
}

fn read(path: &Path) -> Result<String, CaError> {
    fs::read_to_string(path).map_err(|source| CaError::Io {
        path: path.into(),
        source,
    })
}

/// Writes a file completely or not at all, durably (see `flotilla_transport::files`), private
/// when it holds a key.
pub fn write(path: &Path, contents: &str, private: bool) -> Result<(), CaError> {
    let access = if private {
        Access::Private
    } else {
        Access::Public
    };
    write_atomic(path, contents.as_bytes(), access).map_err(|source| CaError::Io {
        path: path.into(),
        source,
    })
}

/// Writes `ca.crt`, `tls.crt` and `tls.key` into `dir`: the layout agents and the CLI read.
pub fn write_bundle(dir: &Path, ca_pem: &str, issued: &IssuedCert) -> Result<(), CaError> {
    fs::create_dir_all(dir).map_err(|source| CaError::Io {
        path: dir.into(),
        source,
    })?;
    write(&dir.join("ca.crt"), ca_pem, false)?;
    write(&dir.join("tls.key"), &issued.key_pem, true)?;
    write(&dir.join("tls.crt"), &issued.cert_pem, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_transport::identity::Peer;
    use rustls_pki_types::{CertificateDer, pem::PemObject};

    #[test]
    fn a_gateway_certificate_serves_and_identifies_a_gateway() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::load_or_create(dir.path()).unwrap();
        let issued = ca
            .issue_gateway("hub", &["localhost".into(), "127.0.0.1".into()])
            .unwrap();
        let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
        assert_eq!(
            Peer::from_der(&der).unwrap(),
            Peer::Gateway { name: "hub".into() }
        );
        // Usable both ways: it serves agents and opens the relay hop as a client.
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        let usage = cert.extended_key_usage().unwrap().unwrap().value;
        assert!(usage.server_auth && usage.client_auth, "{usage:?}");
    }

    #[test]
    fn ca_persists_and_issues_identities_the_gateway_reads() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::load_or_create(dir.path()).unwrap();
        let again = Ca::load_or_create(dir.path()).unwrap();
        assert_eq!(
            ca.cert_pem(),
            again.cert_pem(),
            "second start must reuse the CA"
        );
        assert_eq!(ca.fingerprint(), again.fingerprint());

        let issued = again
            .issue_cluster("store-0042", DEFAULT_CLIENT_CERT_LIFETIME)
            .unwrap();
        let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
        assert_eq!(
            Peer::from_der(&der).unwrap(),
            Peer::Cluster("store-0042".into())
        );
        assert!(
            !format!("{issued:?}").contains("PRIVATE"),
            "keys never print"
        );
    }

    #[test]
    fn a_rotation_makes_earlier_certificates_not_the_current_cas() {
        let dir = tempfile::tempdir().unwrap();
        let old = Ca::load_or_create(dir.path()).unwrap();
        let operator = old.issue_operator("admin", OPERATOR_LIFETIME).unwrap();
        assert!(old.issued(&operator.cert_pem));
        let new = old.rotate(dir.path()).unwrap();
        assert!(!new.issued(&operator.cert_pem), "issued by the previous CA");
        let again = new.issue_operator("admin", OPERATOR_LIFETIME).unwrap();
        assert!(new.issued(&again.cert_pem));
        assert!(!new.issued("not a certificate"));
    }

    const OPERATOR_LIFETIME: Duration = Duration::from_secs(3600);

    /// Whether a client trusting only `roots_pem` accepts `chain_pem` for `localhost`.
    fn verifies(roots_pem: &str, chain_pem: &str) -> bool {
        use rustls::client::danger::ServerCertVerifier;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(roots_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(chain_pem.as_bytes())
                .map(Result::unwrap)
                .collect();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            std::sync::Arc::new(roots),
            std::sync::Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        verifier
            .verify_server_cert(
                &chain[0],
                &chain[1..],
                &rustls_pki_types::ServerName::try_from("localhost").unwrap(),
                &[],
                rustls_pki_types::UnixTime::now(),
            )
            .is_ok()
    }

    #[test]
    fn rotation_keeps_old_and_new_clients_working_through_the_overlap() {
        let dir = tempfile::tempdir().unwrap();
        let old = Ca::load_or_create(dir.path()).unwrap();
        let old_pem = old.cert_pem().to_string();
        let new = old.rotate(dir.path()).unwrap();
        assert!(new.rotating());
        assert!(
            new.rotate(dir.path()).is_err(),
            "no second rotation during an overlap"
        );
        assert_ne!(new.fingerprint(), old.fingerprint());
        assert_eq!(new.bundle_pem(), format!("{}{}", new.cert_pem(), old_pem));

        // A serving certificate from the new CA, presented with the chain: accepted by an agent
        // that trusts only the old CA (cross-signed path) and by one with the new bundle.
        let serving = new.issue_server(&["localhost".into()]).unwrap();
        let chain = new.serving_chain_pem(&serving.cert_pem);
        assert!(
            verifies(&old_pem, &chain),
            "old-CA agents must still connect"
        );
        assert!(verifies(&new.bundle_pem(), &chain));
        assert!(
            !verifies(&old_pem, &serving.cert_pem),
            "the leaf alone is not enough"
        );

        // It survives a restart, and finishing drops the old CA.
        let reloaded = Ca::load_or_create(dir.path()).unwrap();
        assert_eq!(reloaded.bundle_pem(), new.bundle_pem());
        let finished = reloaded.finish_rotation(dir.path()).unwrap();
        assert!(!finished.rotating());
        assert_eq!(finished.bundle_pem(), new.cert_pem());
        assert!(!Ca::load_or_create(dir.path()).unwrap().rotating());
    }

    #[test]
    fn user_certificates_carry_the_users_groups_and_never_reserved_ones() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::load_or_create(dir.path()).unwrap();
        let key = KeyPair::generate().unwrap();
        let csr = CertificateParams::default()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap();
        let groups = vec!["ops".to_string(), "dev".to_string()];
        let cert = ca
            .sign_user_csr("alice", &groups, &csr, Duration::from_secs(60))
            .unwrap();
        let der = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        assert_eq!(
            Peer::from_der(&der).unwrap(),
            Peer::User {
                user: "alice".into(),
                groups
            }
        );
        for (user, groups, why) in [
            ("alice", vec!["system:masters".to_string()], "is reserved"),
            ("system:admin", vec![], "is reserved"),
            ("alice", vec![OPERATOR_GROUP.to_string()], "flotilla's own"),
            ("alice", vec![GATEWAY_GROUP.to_string()], "flotilla's own"),
        ] {
            let err = ca
                .sign_user_csr(user, &groups, &csr, Duration::from_secs(60))
                .unwrap_err()
                .to_string();
            assert!(err.contains(why), "{err}");
        }
    }

    #[test]
    fn signs_csrs_for_the_hubs_name_and_pins_the_requests_key() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::load_or_create(dir.path()).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name = dn("someone-else", &["system:masters"]);
        let csr = params.serialize_request(&key).unwrap().pem().unwrap();
        let (cert, pin) = ca
            .sign_cluster_csr("store-7", &csr, Duration::from_secs(60))
            .unwrap();
        let der = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        assert_eq!(
            Peer::from_der(&der).unwrap(),
            Peer::Cluster("store-7".into())
        );
        assert_eq!(
            flotilla_transport::identity::public_key_sha256(&der).unwrap(),
            pin
        );
        assert_eq!(csr_key_sha256(&csr).unwrap(), pin);
        let err = ca
            .sign_cluster_csr("store-7", "not a csr", Duration::from_secs(60))
            .unwrap_err();
        assert!(err.to_string().contains("PKCS#10"), "{err}");
    }

    #[test]
    fn half_a_ca_is_an_error_that_says_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        Ca::load_or_create(dir.path()).unwrap();
        fs::remove_file(dir.path().join("ca.key")).unwrap();
        let err = Ca::load_or_create(dir.path()).err().unwrap().to_string();
        assert!(err.contains("ca.key is missing"), "{err}");
    }
}
