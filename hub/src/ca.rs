//! The hub's certificate authority: created on first start in the data dir, it signs the
//! gateways' serving certificates, the agents' client certificates and the operators'.

use std::fs;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_gateway::identity::{CLUSTER_GROUP, OPERATOR_GROUP};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
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
}

impl Ca {
    /// Loads the CA from `dir`, creating it (and `dir`) on first start.
    pub fn load_or_create(dir: &Path) -> Result<Ca, CaError> {
        let cert_path = dir.join("ca.crt");
        let key_path = dir.join("ca.key");
        match (cert_path.exists(), key_path.exists()) {
            (true, true) => {
                let cert_pem = read(&cert_path)?;
                let key = KeyPair::from_pem(&read(&key_path)?)?;
                let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)?;
                Ok(Ca { cert_pem, issuer })
            }
            (false, false) => {
                fs::create_dir_all(dir).map_err(|source| CaError::Io {
                    path: dir.into(),
                    source,
                })?;
                let key = KeyPair::generate()?;
                let mut params = CertificateParams::default();
                params.distinguished_name = dn("flotilla hub CA", &["flotilla"]);
                params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
                params.key_usages = vec![
                    KeyUsagePurpose::KeyCertSign,
                    KeyUsagePurpose::CrlSign,
                    KeyUsagePurpose::DigitalSignature,
                ];
                validity(&mut params, CA_LIFETIME);
                let cert = params.self_signed(&key)?;
                write(&key_path, &key.serialize_pem(), true)?;
                write(&cert_path, &cert.pem(), false)?;
                Ok(Ca {
                    cert_pem: cert.pem(),
                    issuer: Issuer::new(params, key),
                })
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

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// SHA-256 of the CA certificate (DER), hex: what a join command pins.
    pub fn fingerprint(&self) -> String {
        use rustls_pki_types::{CertificateDer, pem::PemObject};
        use sha2::Digest;
        let der = CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .expect("the CA certificate was parsed when the CA was loaded");
        hex::encode(sha2::Sha256::digest(der))
    }

    /// A serving certificate for a gateway or the operator API, valid for `names` (DNS names or
    /// IP addresses agents dial).
    pub fn issue_server(&self, names: &[String]) -> Result<IssuedCert, CaError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn("flotilla gateway", &["flotilla"]);
        params.subject_alt_names = names
            .iter()
            .map(|n| match n.parse::<IpAddr>() {
                Ok(ip) => Ok(SanType::IpAddress(ip)),
                Err(_) => Ok(SanType::DnsName(n.clone().try_into()?)),
            })
            .collect::<Result<_, rcgen::Error>>()?;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
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

fn dn(cn: &str, orgs: &[&str]) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    for o in orgs {
        dn.push(DnType::OrganizationName, *o);
    }
    dn
}

fn validity(params: &mut CertificateParams, lifetime: Duration) {
    // Back-date a little: clocks of edge sites drift.
    let now = OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + lifetime;
}

fn read(path: &Path) -> Result<String, CaError> {
    fs::read_to_string(path).map_err(|source| CaError::Io {
        path: path.into(),
        source,
    })
}

/// Writes a file completely or not at all (temp file + rename), private when it holds a key.
pub fn write(path: &Path, contents: &str, private: bool) -> Result<(), CaError> {
    let err = |source| CaError::Io {
        path: path.into(),
        source,
    };
    let tmp = path.with_extension("partial");
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(if private { 0o600 } else { 0o644 });
    }
    let mut f = opts.open(&tmp).map_err(err)?;
    f.write_all(contents.as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
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
    use flotilla_gateway::identity::Peer;
    use rustls_pki_types::{CertificateDer, pem::PemObject};

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
    fn half_a_ca_is_an_error_that_says_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        Ca::load_or_create(dir.path()).unwrap();
        fs::remove_file(dir.path().join("ca.key")).unwrap();
        let err = Ca::load_or_create(dir.path()).err().unwrap().to_string();
        assert!(err.contains("ca.key is missing"), "{err}");
    }
}
