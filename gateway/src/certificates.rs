//! Certificate rotation as the gateway sees it: it answers an agent's `RenewCertificate` over
//! the live session, but the CA key is not its to hold. The hub, which holds it, implements
//! [`ClusterCertificates`]; a gateway without one refuses renewals (and agents keep their
//! current certificate until one that can answers). A `flotilla-gateway` relays them to the hub
//! through the hub apiserver ([`CsrRelay`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flotilla_ops::error_chain;
use flotilla_proto::contract::{
    RENEWAL_CLUSTER_LABEL, RENEWAL_SESSION_KEY_ANNOTATION, RENEWAL_SIGNER,
};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, PostParams, WatchEvent, WatchParams};
use tracing::debug;

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

/// Renewals relayed to the hub through the hub apiserver, for a `flotilla-gateway` (which holds
/// no CA key): each becomes a certificates.k8s.io/v1 CertificateSigningRequest with signerName
/// [`RENEWAL_SIGNER`], labelled with the cluster and annotated with the asking session's key;
/// the hub approves and signs it (the certificate, then the CA bundle, in `status.certificate`)
/// or denies it with the reason, and the gateway deletes it once answered. The hub honours only
/// requests its `--renewal-requesters` created, so the identity the gateway's kubeconfig
/// carries must be among them.
pub struct CsrRelay {
    client: kube::Client,
    /// The gateway's `ca.crt` (`--cert-dir`): what agents trust for it.
    ca_bundle: PathBuf,
    timeout: Duration,
}

/// How long a relayed renewal waits for the hub's answer before the agent is told to retry.
pub const RELAY_TIMEOUT: Duration = Duration::from_secs(30);

impl CsrRelay {
    pub fn new(client: kube::Client, ca_bundle: PathBuf) -> Arc<CsrRelay> {
        Arc::new(CsrRelay {
            client,
            ca_bundle,
            timeout: RELAY_TIMEOUT,
        })
    }

    /// Waits for the hub's decision on `name`, created at `version`.
    async fn decision(
        &self,
        api: &Api<CertificateSigningRequest>,
        cluster: &str,
        name: &str,
        version: &str,
    ) -> Result<RenewedCertificate, RenewalError> {
        let unavailable = |e: kube::Error| {
            RenewalError::Unavailable(format!("waiting for the hub to sign {name}: {e}"))
        };
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(self.timeout.as_secs().try_into().unwrap_or(u32::MAX));
        let mut events = api
            .watch(&params, version)
            .await
            .map_err(unavailable)?
            .boxed();
        while let Some(event) = events.try_next().await.map_err(unavailable)? {
            let csr = match event {
                WatchEvent::Added(csr) | WatchEvent::Modified(csr) => csr,
                WatchEvent::Deleted(_) => {
                    return Err(RenewalError::Unavailable(format!(
                        "the renewal request {name} was deleted before the hub answered"
                    )));
                }
                WatchEvent::Bookmark(_) => continue,
                WatchEvent::Error(e) => {
                    return Err(RenewalError::Unavailable(format!(
                        "waiting for the hub to sign {name}: {}",
                        e.message
                    )));
                }
            };
            if let Some(answer) = answer(cluster, &csr) {
                return answer;
            }
        }
        Err(RenewalError::Unavailable(format!(
            "the hub did not answer the renewal request {name} within {:?}; is the hub running?",
            self.timeout
        )))
    }
}

/// The hub's answer recorded on a renewal request, if it has answered.
fn answer(
    cluster: &str,
    csr: &CertificateSigningRequest,
) -> Option<Result<RenewedCertificate, RenewalError>> {
    let status = csr.status.as_ref()?;
    let conditions = status.conditions.as_deref().unwrap_or_default();
    let refused = conditions
        .iter()
        .find(|c| c.status == "True" && (c.type_ == "Denied" || c.type_ == "Failed"));
    if let Some(c) = refused {
        let message = c.message.clone().unwrap_or_default();
        return Some(Err(match (c.type_.as_str(), c.reason.as_deref()) {
            ("Failed", _) => RenewalError::Unavailable(message),
            (_, Some(RENEWAL_BAD_REQUEST)) => RenewalError::BadRequest(message),
            _ => RenewalError::NotAdmitted {
                cluster: cluster.to_string(),
                reason: message,
            },
        }));
    }
    let issued = status.certificate.as_ref().filter(|c| !c.0.is_empty())?;
    Some(
        split_issued(&String::from_utf8_lossy(&issued.0)).ok_or_else(|| {
            RenewalError::Unavailable(
                "the hub's answer holds no certificate followed by a CA bundle".to_string(),
            )
        }),
    )
}

/// `status.certificate` of a signed renewal: the cluster's certificate, then the CA bundle.
fn split_issued(pem: &str) -> Option<RenewedCertificate> {
    const END: &str = "-----END CERTIFICATE-----";
    let end = pem.find(END)? + END.len();
    let (certificate, bundle) = pem.split_at(end);
    let bundle = bundle.trim_start();
    (!bundle.is_empty()).then(|| RenewedCertificate {
        certificate_pem: format!("{certificate}\n"),
        ca_bundle_pem: bundle.to_string(),
    })
}

/// Joins what [`split_issued`] splits: the hub writes this into `status.certificate`.
pub fn join_issued(renewed: &RenewedCertificate) -> String {
    format!(
        "{}\n{}",
        renewed.certificate_pem.trim_end(),
        renewed.ca_bundle_pem
    )
}

/// `reason` of a renewal denied because the request itself is unusable.
pub const RENEWAL_BAD_REQUEST: &str = "BadRequest";
/// `reason` of a renewal denied because the cluster may not renew.
pub const RENEWAL_NOT_ADMITTED: &str = "NotAdmitted";

#[async_trait]
impl ClusterCertificates for CsrRelay {
    async fn renew(
        &self,
        cluster: &str,
        current_key_sha256: &str,
        csr_pem: &str,
    ) -> Result<RenewedCertificate, RenewalError> {
        let api: Api<CertificateSigningRequest> = Api::all(self.client.clone());
        let request = CertificateSigningRequest {
            metadata: ObjectMeta {
                generate_name: Some("flotilla-renewal-".to_string()),
                labels: Some(BTreeMap::from([(
                    RENEWAL_CLUSTER_LABEL.to_string(),
                    cluster.to_string(),
                )])),
                annotations: Some(BTreeMap::from([(
                    RENEWAL_SESSION_KEY_ANNOTATION.to_string(),
                    current_key_sha256.to_string(),
                )])),
                ..Default::default()
            },
            spec: CertificateSigningRequestSpec {
                request: ByteString(csr_pem.as_bytes().to_vec()),
                signer_name: RENEWAL_SIGNER.to_string(),
                usages: Some(vec!["digital signature".into(), "client auth".into()]),
                ..Default::default()
            },
            status: None,
        };
        let created = api
            .create(&PostParams::default(), &request)
            .await
            .map_err(|e| match e {
                kube::Error::Api(s) if s.code == 422 || s.code == 400 => {
                    RenewalError::BadRequest(s.message)
                }
                e => RenewalError::Unavailable(format!(
                    "relaying the renewal of {cluster} to the hub: {e}"
                )),
            })?;
        let name = created.metadata.name.clone().unwrap_or_default();
        let version = created
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default();
        let decided = match answer(cluster, &created) {
            Some(answer) => answer,
            None => self.decision(&api, cluster, &name, &version).await,
        };
        // Answered or given up: the request has served its purpose either way (the hub also
        // collects requests nobody deleted).
        if let Err(e) = api.delete(&name, &DeleteParams::default()).await {
            debug!(request = %name, error = %error_chain(&e), "deleting an answered renewal request failed");
        }
        decided
    }

    fn ca_bundle(&self) -> String {
        std::fs::read_to_string(&self.ca_bundle).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_issued_certificate_and_its_bundle_survive_the_round_trip() {
        let cert = "-----BEGIN CERTIFICATE-----\nAAA\n-----END CERTIFICATE-----\n";
        let bundle = "-----BEGIN CERTIFICATE-----\nBBB\n-----END CERTIFICATE-----\n-----BEGIN CERTIFICATE-----\nCCC\n-----END CERTIFICATE-----\n";
        let joined = join_issued(&RenewedCertificate {
            certificate_pem: cert.to_string(),
            ca_bundle_pem: bundle.to_string(),
        });
        let split = split_issued(&joined).expect("both parts");
        assert_eq!(split.certificate_pem, cert);
        assert_eq!(split.ca_bundle_pem, bundle);
        assert!(
            split_issued(cert).is_none(),
            "a certificate alone has no bundle"
        );
    }
}
