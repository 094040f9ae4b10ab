//! The certificates and keys one test environment needs, made fresh at start.
//!
//! Everything is ECDSA P-256: rcgen's ring backend cannot generate RSA keys, and kube-apiserver
//! accepts EC keys for serving, for client certificates and for signing service-account tokens
//! (ES256).

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// The admin user's name, as the apiserver sees it (the client certificate's CN).
pub const ADMIN_USER: &str = "flotilla-test-admin";
/// The admin user's group. `system:masters` is allowed everything before RBAC is consulted, so the
/// admin works from the first request, without waiting for RBAC's bootstrap roles.
pub const ADMIN_GROUP: &str = "system:masters";

/// PEM text for every file the apiserver and the kubeconfig need.
pub(crate) struct Pki {
    /// Signs the serving certificate; the kubeconfig trusts it, so clients verify the server for
    /// real rather than skipping verification.
    pub serving_ca_cert: String,
    pub serving_cert: String,
    pub serving_key: String,
    /// A separate CA for client certificates (`--client-ca-file`), so trusting the server and
    /// authenticating users stay independent, as in a real cluster.
    pub client_ca_cert: String,
    pub admin_cert: String,
    pub admin_key: String,
    /// Signs service-account tokens (`--service-account-signing-key-file`).
    pub service_account_key: String,
    /// Verifies them (`--service-account-key-file`).
    pub service_account_public_key: String,
    /// Signs the kubelets' serving certificates; the apiserver verifies every kubelet it dials
    /// against it (`--kubelet-certificate-authority`), as it should against a real node's.
    pub kubelet_ca_cert: String,
    /// The serving certificate of the (kwok-simulated) kubelets, for 127.0.0.1, where the
    /// nodes' InternalIP points.
    pub kubelet_serving_cert: String,
    pub kubelet_serving_key: String,
}

impl Pki {
    /// `extra_addresses` join the serving certificate's names.
    pub(crate) fn generate(extra_addresses: &[std::net::IpAddr]) -> anyhow::Result<Pki> {
        let serving_ca = new_ca("flotilla-testenv-serving-ca")?;
        let client_ca = new_ca("flotilla-testenv-client-ca")?;

        // Names a client inside or outside the "cluster" might use for the apiserver.
        let mut names = vec![
            "127.0.0.1".to_owned(),
            "localhost".to_owned(),
            "kubernetes".to_owned(),
            "kubernetes.default".to_owned(),
            "kubernetes.default.svc".to_owned(),
            // The first address of --service-cluster-ip-range: the `kubernetes` Service.
            "10.0.0.1".to_owned(),
        ];
        names.extend(extra_addresses.iter().map(|a| a.to_string()));
        let mut serving = CertificateParams::new(names)?;
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        serving.use_authority_key_identifier_extension = true;
        let serving_key = KeyPair::generate().context("generating the serving key")?;
        let serving_cert = serving
            .signed_by(&serving_key, &serving_ca)
            .context("signing the serving certificate")?;

        let mut admin = CertificateParams::new(Vec::<String>::new())?;
        admin
            .distinguished_name
            .push(DnType::CommonName, ADMIN_USER);
        admin
            .distinguished_name
            .push(DnType::OrganizationName, ADMIN_GROUP);
        admin.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        admin.use_authority_key_identifier_extension = true;
        let admin_key = KeyPair::generate().context("generating the admin key")?;
        let admin_cert = admin
            .signed_by(&admin_key, &client_ca)
            .context("signing the admin certificate")?;

        let service_account_key =
            KeyPair::generate().context("generating the service-account key")?;

        let kubelet_ca = new_ca("flotilla-testenv-kubelet-ca")?;
        let mut kubelet =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])?;
        kubelet
            .distinguished_name
            .push(DnType::CommonName, "kwok-kubelet");
        kubelet.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        kubelet.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        kubelet.use_authority_key_identifier_extension = true;
        let kubelet_key = KeyPair::generate().context("generating the kubelet serving key")?;
        let kubelet_cert = kubelet
            .signed_by(&kubelet_key, &kubelet_ca)
            .context("signing the kubelet serving certificate")?;

        Ok(Pki {
            serving_ca_cert: serving_ca.pem(),
            serving_cert: serving_cert.pem(),
            serving_key: serving_key.serialize_pem(),
            client_ca_cert: client_ca.pem(),
            admin_cert: admin_cert.pem(),
            admin_key: admin_key.serialize_pem(),
            service_account_key: service_account_key.serialize_pem(),
            service_account_public_key: service_account_key.public_key_pem(),
            kubelet_ca_cert: kubelet_ca.pem(),
            kubelet_serving_cert: kubelet_cert.pem(),
            kubelet_serving_key: kubelet_key.serialize_pem(),
        })
    }
}

fn new_ca(name: &str) -> anyhow::Result<CertifiedIssuer<'static, KeyPair>> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().with_context(|| format!("generating the {name} key"))?;
    CertifiedIssuer::self_signed(params, key).with_context(|| format!("self-signing {name}"))
}
