//! The agent's identity on disk: its private key, its certificate and the CA bundle it trusts
//! for the hub, in one directory (`<data-dir>/identity`, or `--cert-dir`), keys with mode 0600.
//!
//! Keys are made here and never leave the spoke: joining and renewing send certificate signing
//! requests only. A renewal writes the new key to `next.key` before asking, and the signed
//! certificate to `next.crt` before moving both into place, so a crash at any point leaves
//! either the old pair or the new one ([`Identity::recover`] finishes a half-done switch).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use flotilla_transport::files::{Access, write_atomic};
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};

/// CA certificates the agent trusts for the hub (PEM bundle; two during a CA rotation).
pub const CA_FILE: &str = "ca.crt";
/// This cluster's client certificate.
pub const CERT_FILE: &str = "tls.crt";
/// This cluster's private key (0600).
pub const KEY_FILE: &str = "tls.key";
/// The key of a join in progress (0600): reused when the agent comes back to a pending join,
/// so the hub sees the same key and re-attaches it to the recorded request.
pub const JOIN_KEY_FILE: &str = "join.key";
/// The key of a renewal in progress (0600).
pub const NEXT_KEY_FILE: &str = "next.key";
/// The certificate of a renewal, before it replaces [`CERT_FILE`].
pub const NEXT_CERT_FILE: &str = "next.crt";

/// Errors reading or writing the identity; `Io` is retryable, the others need a rejoin.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A file could not be read or written. Retryable once the disk is fixed.
    #[error("agent identity file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Key generation or CSR encoding failed. Not retryable (a broken crypto provider).
    #[error("making a key or certificate request: {0}")]
    Crypto(String),
    /// A stored or received certificate does not parse, or is not for the key it should be.
    /// Not retryable with the same files: join again with a new token.
    #[error("{0}")]
    Invalid(String),
}

/// The identity directory.
#[derive(Clone, Debug)]
pub struct Identity {
    dir: PathBuf,
}

impl Identity {
    pub fn new(dir: impl Into<PathBuf>) -> Identity {
        Identity { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a complete identity (CA bundle, certificate, key) is on disk.
    pub fn exists(&self) -> bool {
        [CA_FILE, CERT_FILE, KEY_FILE]
            .iter()
            .all(|f| self.dir.join(f).exists())
    }

    /// Finishes a renewal that a crash interrupted after the new certificate was stored.
    pub fn recover(&self) -> Result<(), IdentityError> {
        let next_cert = self.dir.join(NEXT_CERT_FILE);
        if !next_cert.exists() {
            return Ok(());
        }
        let next_key = self.dir.join(NEXT_KEY_FILE);
        if next_key.exists() {
            rename(&next_key, &self.dir.join(KEY_FILE))?;
        }
        rename(&next_cert, &self.dir.join(CERT_FILE))
    }

    /// The key for a join: the one of an earlier attempt if there is one, else a new one,
    /// stored before it is used. Returns its CSR for `cluster`.
    pub fn join_request(&self, cluster: &str) -> Result<String, IdentityError> {
        let key = self.key_in(JOIN_KEY_FILE)?;
        csr(&key, cluster)
    }

    /// Stores what an accepted join returned: the CA bundle, the certificate, and the join key
    /// as the cluster's key. Checks the certificate is for that key.
    pub fn complete_join(
        &self,
        certificate_pem: &str,
        ca_bundle_pem: &str,
    ) -> Result<(), IdentityError> {
        let key_path = self.dir.join(JOIN_KEY_FILE);
        let key = KeyPair::from_pem(&read(&key_path)?)
            .map_err(|e| IdentityError::Invalid(format!("{}: {e}", key_path.display())))?;
        check_certificate_for(certificate_pem, &key)?;
        write(&self.dir.join(CA_FILE), ca_bundle_pem, false)?;
        write(&self.dir.join(NEXT_CERT_FILE), certificate_pem, false)?;
        rename(&key_path, &self.dir.join(KEY_FILE))?;
        rename(&self.dir.join(NEXT_CERT_FILE), &self.dir.join(CERT_FILE))
    }

    /// The key for a renewal (an earlier attempt's, or a new one stored first) and its CSR.
    pub fn renewal_request(&self, cluster: &str) -> Result<String, IdentityError> {
        let key = self.key_in(NEXT_KEY_FILE)?;
        csr(&key, cluster)
    }

    /// Stores a renewed certificate for the renewal key and switches to it (for the next
    /// connection; the running session is unaffected).
    pub fn complete_renewal(
        &self,
        certificate_pem: &str,
        ca_bundle_pem: &str,
    ) -> Result<(), IdentityError> {
        let key_path = self.dir.join(NEXT_KEY_FILE);
        let key = KeyPair::from_pem(&read(&key_path)?)
            .map_err(|e| IdentityError::Invalid(format!("{}: {e}", key_path.display())))?;
        check_certificate_for(certificate_pem, &key)?;
        if !ca_bundle_pem.is_empty() {
            write(&self.dir.join(CA_FILE), ca_bundle_pem, false)?;
        }
        write(&self.dir.join(NEXT_CERT_FILE), certificate_pem, false)?;
        self.recover()
    }

    /// Replaces the trusted CA bundle (after a hub CA rotation).
    pub fn update_ca_bundle(&self, ca_bundle_pem: &str) -> Result<(), IdentityError> {
        write(&self.dir.join(CA_FILE), ca_bundle_pem, false)
    }

    /// Hex SHA-256 of the stored CA bundle, as the hello reports it ("" if none).
    pub fn ca_bundle_sha256(&self) -> String {
        fs::read(self.dir.join(CA_FILE))
            .map(flotilla_proto::contract::ca_bundle_sha256)
            .unwrap_or_default()
    }

    /// The validity of the stored certificate.
    pub fn validity(&self) -> Result<(SystemTime, SystemTime), IdentityError> {
        let pem = read(&self.dir.join(CERT_FILE))?;
        validity(&pem)
    }

    fn key_in(&self, file: &str) -> Result<KeyPair, IdentityError> {
        let path = self.dir.join(file);
        if path.exists()
            && let Ok(key) = KeyPair::from_pem(&read(&path)?)
        {
            return Ok(key);
        }
        let key = KeyPair::generate().map_err(|e| IdentityError::Crypto(e.to_string()))?;
        fs::create_dir_all(&self.dir).map_err(|source| IdentityError::Io {
            path: self.dir.clone(),
            source,
        })?;
        write(&path, &key.serialize_pem(), true)?;
        Ok(key)
    }
}

/// A PKCS#10 request for `key`, CN = the cluster (the hub ignores the subject and names the
/// certificate after the session or join it signs for).
fn csr(key: &KeyPair, cluster: &str) -> Result<String, IdentityError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cluster);
    params.distinguished_name = dn;
    params
        .serialize_request(key)
        .and_then(|r| r.pem())
        .map_err(|e| IdentityError::Crypto(e.to_string()))
}

fn check_certificate_for(certificate_pem: &str, key: &KeyPair) -> Result<(), IdentityError> {
    use rustls_pki_types::{CertificateDer, pem::PemObject};
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = CertificateDer::from_pem_slice(certificate_pem.as_bytes())
        .map_err(|e| IdentityError::Invalid(format!("certificate from the hub: {e}")))?;
    let (_, cert) = X509Certificate::from_der(&der)
        .map_err(|e| IdentityError::Invalid(format!("certificate from the hub: {e}")))?;
    if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
        return Err(IdentityError::Invalid(
            "the hub's certificate is not for this agent's key; not stored".into(),
        ));
    }
    Ok(())
}

fn validity(certificate_pem: &str) -> Result<(SystemTime, SystemTime), IdentityError> {
    use rustls_pki_types::{CertificateDer, pem::PemObject};
    use x509_parser::prelude::{FromDer, X509Certificate};
    let invalid = |e: String| IdentityError::Invalid(format!("stored certificate: {e}"));
    let der = CertificateDer::from_pem_slice(certificate_pem.as_bytes())
        .map_err(|e| invalid(e.to_string()))?;
    let (_, cert) = X509Certificate::from_der(&der).map_err(|e| invalid(e.to_string()))?;
    let at = |t: i64| {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(u64::try_from(t).unwrap_or(0))
    };
    Ok((
        at(cert.validity().not_before.timestamp()),
        at(cert.validity().not_after.timestamp()),
    ))
}

fn read(path: &Path) -> Result<String, IdentityError> {
    fs::read_to_string(path).map_err(|source| IdentityError::Io {
        path: path.into(),
        source,
    })
}

fn rename(from: &Path, to: &Path) -> Result<(), IdentityError> {
    fs::rename(from, to).map_err(|source| IdentityError::Io {
        path: to.into(),
        source,
    })
}

/// Writes a file completely or not at all (temp file, fsync, rename); keys with mode 0600.
fn write(path: &Path, contents: &str, private: bool) -> Result<(), IdentityError> {
    let access = if private {
        Access::Private
    } else {
        Access::Public
    };
    write_atomic(path, contents.as_bytes(), access).map_err(|source| IdentityError::Io {
        path: path.into(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate for the key in `key_file`, signed by a throwaway CA.
    fn sign(dir: &Path, key_file: &str) -> String {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::default();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = KeyPair::from_pem(&fs::read_to_string(dir.join(key_file)).unwrap()).unwrap();
        CertificateParams::default()
            .signed_by(&key, &issuer)
            .unwrap()
            .pem()
    }

    #[test]
    fn join_then_renew_switches_keys_and_keeps_them_private() {
        let dir = tempfile::tempdir().unwrap();
        let id = Identity::new(dir.path());
        id.join_request("store-1").unwrap();
        let join_key = fs::read_to_string(dir.path().join(JOIN_KEY_FILE)).unwrap();
        id.join_request("store-1").unwrap();
        assert_eq!(
            join_key,
            fs::read_to_string(dir.path().join(JOIN_KEY_FILE)).unwrap(),
            "a retried join reuses its key"
        );
        let cert = sign(dir.path(), JOIN_KEY_FILE);
        id.complete_join(&cert, "CA").unwrap();
        assert!(id.exists() && !dir.path().join(JOIN_KEY_FILE).exists());
        let old_key = fs::read_to_string(dir.path().join(KEY_FILE)).unwrap();

        id.renewal_request("store-1").unwrap();
        let renewed = sign(dir.path(), NEXT_KEY_FILE);
        // A certificate for another key is refused and changes nothing.
        assert!(id.complete_renewal(&cert, "").is_err());
        id.complete_renewal(&renewed, "CA2").unwrap();
        assert_ne!(
            fs::read_to_string(dir.path().join(KEY_FILE)).unwrap(),
            old_key
        );
        assert_eq!(
            fs::read_to_string(dir.path().join(CERT_FILE)).unwrap(),
            renewed
        );
        assert_eq!(fs::read_to_string(dir.path().join(CA_FILE)).unwrap(), "CA2");
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(dir.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let (from, to) = id.validity().unwrap();
        assert!(from < to);
    }

    #[test]
    fn a_renewal_cut_short_after_storing_the_certificate_completes_on_recover() {
        let dir = tempfile::tempdir().unwrap();
        let id = Identity::new(dir.path());
        id.renewal_request("store-1").unwrap();
        let renewed = sign(dir.path(), NEXT_KEY_FILE);
        fs::write(dir.path().join(NEXT_CERT_FILE), &renewed).unwrap();
        id.recover().unwrap();
        assert_eq!(
            fs::read_to_string(dir.path().join(CERT_FILE)).unwrap(),
            renewed
        );
        assert!(dir.path().join(KEY_FILE).exists());
    }
}
