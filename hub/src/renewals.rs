//! The hub's side of relayed renewals (scale-out mode): `flotilla-gateway`s hold no CA key, so
//! they relay an agent's renewal as a certificates.k8s.io/v1 CertificateSigningRequest with
//! signerName [`RENEWAL_SIGNER`] (see `flotilla_gateway::certificates::CsrRelay`). This task
//! watches those requests and answers each once, with the same checks as a renewal on the hub's
//! own gateway ([`HubCertificates`]): the request's key is registered for the cluster, the
//! cluster is accepted and not denied. A request is honoured only if one of
//! `--renewal-requesters` created it (`spec.username`, set by the apiserver): whoever else may
//! create CertificateSigningRequests on the hub apiserver gets a denial, not a certificate.
//! Signed: Approved, then `status.certificate` = the certificate followed by the CA bundle.
//! Refused: Denied (or Failed, when the hub could not decide now) with the reason.
//! Requests nobody deleted are collected after [`STALE_AFTER`].

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use flotilla_gateway::certificates::{
    ClusterCertificates, RENEWAL_BAD_REQUEST, RENEWAL_NOT_ADMITTED, RenewalError, join_issued,
};
use flotilla_proto::contract::{
    RENEWAL_CLUSTER_LABEL, RENEWAL_SESSION_KEY_ANNOTATION, RENEWAL_SIGNER,
};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, WatchEvent, WatchParams};
use tokio::sync::{Mutex, Semaphore, watch};
use tracing::{debug, info, warn};

use crate::registration::HubCertificates;

/// Renewals answered at once.
pub const CONCURRENCY: usize = 8;
/// A renewal request older than this is deleted: its gateway gave up on it long ago.
pub const STALE_AFTER: Duration = Duration::from_secs(15 * 60);
/// Longest wait between two attempts to list or watch after failures.
const RETRY_MAX: Duration = Duration::from_secs(10);

/// Answers relayed renewals until `stop` fires.
pub async fn sign_relayed(
    client: kube::Client,
    certificates: Arc<HubCertificates>,
    requesters: Vec<String>,
    mut stop: watch::Receiver<bool>,
) {
    let api: Api<CertificateSigningRequest> = Api::all(client);
    let signer = Signer {
        api: api.clone(),
        certificates,
        requesters: Arc::new(requesters.into_iter().collect()),
        slots: Arc::new(Semaphore::new(CONCURRENCY)),
        in_flight: Arc::default(),
    };
    let selector = format!("spec.signerName={RENEWAL_SIGNER}");
    let mut delay = Duration::from_millis(200);
    loop {
        if *stop.borrow() {
            return;
        }
        let round = async {
            let list = api.list(&ListParams::default().fields(&selector)).await?;
            for csr in list.items {
                signer.consider(csr).await;
            }
            let version = list.metadata.resource_version.unwrap_or_default();
            let params = WatchParams::default().fields(&selector).timeout(290);
            let mut events = api.watch(&params, &version).await?.boxed();
            while let Some(event) = events.try_next().await? {
                match event {
                    WatchEvent::Added(csr) | WatchEvent::Modified(csr) => {
                        signer.consider(csr).await
                    }
                    WatchEvent::Error(e) if e.code == 410 => break,
                    WatchEvent::Error(e) => return Err(kube::Error::Api(e)),
                    WatchEvent::Deleted(_) | WatchEvent::Bookmark(_) => {}
                }
            }
            Ok::<(), kube::Error>(())
        };
        let failed = tokio::select! {
            r = round => r.err(),
            _ = stop.changed() => return,
        };
        match failed {
            None => delay = Duration::from_millis(200),
            Some(e) => {
                warn!(error = %e, ?delay, "watching relayed renewal requests failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = stop.changed() => return,
                }
                delay = (delay * 2).min(RETRY_MAX);
            }
        }
    }
}

#[derive(Clone)]
struct Signer {
    api: Api<CertificateSigningRequest>,
    certificates: Arc<HubCertificates>,
    requesters: Arc<HashSet<String>>,
    slots: Arc<Semaphore>,
    /// Requests being answered now: the watch shows the approval before the certificate.
    in_flight: Arc<Mutex<HashSet<String>>>,
}

/// How the hub answers one request.
enum Decision {
    Sign(String),
    Deny {
        reason: &'static str,
        message: String,
    },
    Fail(String),
}

impl Signer {
    /// Answers `csr` off the watch (a bounded number at a time) unless it is answered already;
    /// deletes it if it is stale.
    async fn consider(&self, csr: CertificateSigningRequest) {
        let Some(name) = csr.metadata.name.clone() else {
            return;
        };
        let age = csr
            .metadata
            .creation_timestamp
            .as_ref()
            .and_then(|t| jiff::Timestamp::now().duration_since(t.0).try_into().ok())
            .unwrap_or(Duration::ZERO);
        if age > STALE_AFTER {
            if let Err(e) = self.api.delete(&name, &DeleteParams::default()).await {
                debug!(request = %name, error = %e, "deleting a stale renewal request failed");
            }
            return;
        }
        if answered(&csr) || !self.in_flight.lock().await.insert(name.clone()) {
            return;
        }
        let Ok(slot) = self.slots.clone().acquire_owned().await else {
            return;
        };
        let signer = self.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let decision = signer.decide(&csr).await;
            if let Err(e) = signer.record(&name, decision).await {
                warn!(request = %name, error = %e, "recording the answer to a renewal request failed; the gateway will ask again");
            }
            signer.in_flight.lock().await.remove(&name);
        });
    }

    async fn decide(&self, csr: &CertificateSigningRequest) -> Decision {
        let requester = csr.spec.username.clone().unwrap_or_default();
        if !self.requesters.contains(&requester) {
            return Decision::Deny {
                reason: RENEWAL_NOT_ADMITTED,
                message: format!(
                    "created by {requester:?}, which is not among the hub's --renewal-requesters (the gateways' identities on the hub apiserver)"
                ),
            };
        }
        let label = |key: &str| {
            csr.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(key).cloned())
        };
        let annotation = |key: &str| {
            csr.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(key).cloned())
        };
        let (Some(cluster), Some(key)) = (
            label(RENEWAL_CLUSTER_LABEL),
            annotation(RENEWAL_SESSION_KEY_ANNOTATION),
        ) else {
            return Decision::Deny {
                reason: RENEWAL_BAD_REQUEST,
                message: format!(
                    "a renewal request needs the label {RENEWAL_CLUSTER_LABEL} and the annotation {RENEWAL_SESSION_KEY_ANNOTATION}"
                ),
            };
        };
        let request = String::from_utf8_lossy(&csr.spec.request.0);
        match self.certificates.renew(&cluster, &key, &request).await {
            Ok(renewed) => {
                info!(%cluster, "client certificate renewed for a gateway's session");
                Decision::Sign(join_issued(&renewed))
            }
            Err(RenewalError::BadRequest(m)) => Decision::Deny {
                reason: RENEWAL_BAD_REQUEST,
                message: m,
            },
            Err(e @ RenewalError::NotAdmitted { .. }) => Decision::Deny {
                reason: RENEWAL_NOT_ADMITTED,
                message: e.to_string(),
            },
            Err(RenewalError::Unavailable(m)) => Decision::Fail(m),
        }
    }

    /// Writes the decision: the approval (or denial) first, then the certificate (or failure).
    async fn record(&self, name: &str, decision: Decision) -> Result<(), kube::Error> {
        let condition =
            |type_: &str, reason: &str, message: String| CertificateSigningRequestCondition {
                type_: type_.to_string(),
                status: "True".to_string(),
                reason: Some(reason.to_string()),
                message: Some(message),
                last_update_time: Some(Time(jiff::Timestamp::now())),
                ..Default::default()
            };
        let conditions = |c: CertificateSigningRequestCondition| {
            Patch::Merge(serde_json::json!({ "status": { "conditions": [c] } }))
        };
        let params = PatchParams::default();
        match decision {
            Decision::Sign(issued) => {
                let approved = condition(
                    "Approved",
                    "FlotillaRenewal",
                    "the session's key is registered for its cluster".to_string(),
                );
                self.api
                    .patch_approval(name, &params, &conditions(approved))
                    .await?;
                let certificate = serde_json::json!({ "status": {
                    "certificate": ByteString(issued.into_bytes()),
                }});
                self.api
                    .patch_status(name, &params, &Patch::Merge(certificate))
                    .await?;
            }
            Decision::Deny { reason, message } => {
                info!(request = %name, %reason, %message, "renewal request denied");
                self.api
                    .patch_approval(
                        name,
                        &params,
                        &conditions(condition("Denied", reason, message)),
                    )
                    .await?;
            }
            Decision::Fail(message) => {
                self.api
                    .patch_status(
                        name,
                        &params,
                        &conditions(condition("Failed", "Unavailable", message)),
                    )
                    .await?;
            }
        }
        Ok(())
    }
}

/// Whether the hub has answered `csr` already.
fn answered(csr: &CertificateSigningRequest) -> bool {
    csr.status.as_ref().is_some_and(|s| {
        s.certificate.as_ref().is_some_and(|c| !c.0.is_empty())
            || s.conditions
                .as_deref()
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Denied" || c.type_ == "Failed")
    })
}
