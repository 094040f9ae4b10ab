//! Joining the fleet, OCM's double opt-in: an agent with a bootstrap token sends a CSR for a
//! key it made itself (`Registration.Join`), the hub records a ManagedCluster with
//! `hubAcceptsClient: false`, and only when an operator accepts it (or the token's auto-accept
//! rule does) does the hub sign the certificate and hand it to the waiting agent.
//!
//! The cluster's registered key (its pin, see `flotilla_gateway::admission`) is recorded with
//! the request, so a second join for a taken name with another key is refused, and the pin is
//! what every gateway checks at every session. Renewals over the session
//! ([`HubCertificates`]) move the pin to the new key. Operators accept, deny and revoke through
//! [`accept`], [`deny`] and deleting the ManagedCluster.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use flotilla_gateway::admission::{Admissions, ClusterAdmission, key_pins};
use flotilla_gateway::certificates::{ClusterCertificates, RenewalError, RenewedCertificate};
use flotilla_proto::api::Kind;
use flotilla_proto::contract::is_dns1123_label;
use flotilla_proto::contract::{
    DENIED_ANNOTATION, KEY_PINS_ANNOTATION, REQUESTED_AT_ANNOTATION, TOKEN_ANNOTATION,
};
use flotilla_proto::wire::registration_server::{Registration, RegistrationServer};
use flotilla_proto::wire::{JoinRequest, JoinUpdate, join_update};
use flotilla_store::{Store, StoreError};
use flotilla_transport::tls::ConnInfo;
use futures::Stream;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::ca::{self, Ca, CaError};
use crate::controllers::shard_labels;
use crate::tokens::{BootstrapTokens, Use};

/// How often a waiting join hears PENDING again: keeps the stream visibly alive through
/// proxies that cut idle connections, and notices an agent that went away.
pub const PENDING_REMINDER: Duration = Duration::from_secs(20);
/// Most keys a cluster has registered at once: the newest and the one before, so an agent that
/// crashed between asking for a renewed certificate and storing it still gets in.
pub const MAX_KEY_PINS: usize = 2;
/// Attempts of a read-modify-write of a ManagedCluster against concurrent writers.
const WRITE_ATTEMPTS: usize = 5;

/// The hub CA as the running hub uses it: replaced as a whole on rotation; readers take the
/// current one. A std RwLock because no holder ever awaits (signing is synchronous and short).
pub struct Authority {
    dir: PathBuf,
    ca: RwLock<Arc<Ca>>,
}

impl Authority {
    pub fn new(dir: PathBuf, ca: Ca) -> Arc<Authority> {
        Arc::new(Authority {
            dir,
            ca: RwLock::new(Arc::new(ca)),
        })
    }

    /// The CA now.
    pub fn current(&self) -> Arc<Ca> {
        self.ca.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Rotates to a new CA with overlap ([`Ca::rotate`]) and returns it.
    pub fn rotate(&self) -> Result<Arc<Ca>, CaError> {
        let next = Arc::new(self.current().rotate(&self.dir)?);
        *self.ca.write().unwrap_or_else(|e| e.into_inner()) = next.clone();
        info!(fingerprint = %next.fingerprint(), "hub CA rotated; the previous CA stays trusted until the rotation is finished");
        Ok(next)
    }

    /// Ends the overlap ([`Ca::finish_rotation`]) and returns the CA.
    pub fn finish_rotation(&self) -> Result<Arc<Ca>, CaError> {
        let next = Arc::new(self.current().finish_rotation(&self.dir)?);
        *self.ca.write().unwrap_or_else(|e| e.into_inner()) = next.clone();
        info!("CA rotation finished: only the current CA is trusted");
        Ok(next)
    }
}

/// Why a join or a renewal got no certificate, as the agent and the hub's log read it.
#[derive(Debug, thiserror::Error)]
pub enum JoinRefusal {
    /// The cluster name is not a DNS-1123 label. Not retryable: fix --cluster-name.
    #[error(
        "cluster name {0:?} is not valid: lower-case letters, digits and '-', at most 63 characters (it becomes a namespace)"
    )]
    InvalidName(String),
    /// The token does not admit the join (expired, revoked, used up, unknown). Not retryable.
    #[error("{0}")]
    Token(#[from] crate::tokens::TokenError),
    /// The CSR is unusable. Not retryable with the same request.
    #[error("{0}")]
    Csr(CaError),
    /// Another key holds the name. Not retryable: pick another name, or delete the old cluster.
    #[error(
        "cluster name {cluster} is already registered with a different key: choose another \
         --cluster-name, or, if the old spoke is gone, delete it first (`flotilla cluster delete {cluster}`)"
    )]
    NameTaken { cluster: String },
    /// An operator denied the cluster. Not retryable until it is deleted.
    #[error(
        "cluster {cluster} was denied by the hub: {reason}; an operator must delete it \
         (`flotilla cluster delete {cluster}`) before it can join again"
    )]
    Denied { cluster: String, reason: String },
    /// Deleted while the agent waited. Not retryable: join again with a token.
    #[error(
        "cluster {cluster} was deleted while its join was pending: join again with a new token"
    )]
    Deleted { cluster: String },
    /// The store or the CA failed. Retryable.
    #[error("the hub cannot record the join now: {0}; retrying later may help")]
    Unavailable(String),
}

impl From<StoreError> for JoinRefusal {
    fn from(e: StoreError) -> Self {
        JoinRefusal::Unavailable(e.to_string())
    }
}

/// The `Registration` gRPC service.
#[derive(Clone)]
pub struct JoinService {
    store: Arc<dyn Store>,
    tokens: Arc<BootstrapTokens>,
    authority: Arc<Authority>,
    admissions: Arc<Admissions>,
    client_cert_lifetime: Duration,
    /// The fleet's virtual shards: a recorded cluster carries its shard's label from the
    /// start, so the gateway that holds it sees it without waiting for the labeller.
    shards: u32,
}

impl JoinService {
    pub fn new(
        store: Arc<dyn Store>,
        tokens: Arc<BootstrapTokens>,
        authority: Arc<Authority>,
        admissions: Arc<Admissions>,
        client_cert_lifetime: Duration,
    ) -> JoinService {
        JoinService {
            store,
            tokens,
            authority,
            admissions,
            client_cert_lifetime,
            shards: flotilla_proto::contract::DEFAULT_SHARDS,
        }
    }

    /// The fleet's virtual shards (`--shards`), for the label of the clusters it records.
    pub fn with_shards(mut self, shards: u32) -> JoinService {
        self.shards = shards;
        self
    }

    pub fn into_server(self) -> RegistrationServer<JoinService> {
        // CSRs are ~1 KiB; nothing legitimate comes near this.
        RegistrationServer::new(self).max_decoding_message_size(64 * 1024)
    }

    /// One join, from the request to ACCEPTED or DENIED. Returns the last update to send.
    async fn run(
        &self,
        request: JoinRequest,
        updates: &mpsc::Sender<Result<JoinUpdate, Status>>,
    ) -> Result<JoinUpdate, JoinRefusal> {
        let cluster = request.cluster_name.clone();
        if !is_dns1123_label(&cluster) {
            return Err(JoinRefusal::InvalidName(cluster));
        }
        // The token first: without a valid one, nothing about the fleet's names is revealed.
        self.tokens.redeem(&request.token, Use::Reattach).await?;
        let key = ca::csr_key_sha256(&request.csr_pem).map_err(JoinRefusal::Csr)?;
        self.record(&request, &key).await?;

        let mut changes = self.admissions.changes();
        let mut told_pending = false;
        loop {
            let admission = match self.admissions.get(&cluster) {
                Some(a) => Some(a),
                // The cache may not have seen our own write yet: ask the store.
                None => self
                    .store
                    .get(Kind::ManagedCluster, None, &cluster)
                    .await?
                    .as_ref()
                    .map(ClusterAdmission::from_object),
            };
            let Some(admission) = admission else {
                return Err(JoinRefusal::Deleted { cluster });
            };
            if let Some(reason) = admission.denied {
                return Err(JoinRefusal::Denied { cluster, reason });
            }
            if !admission.key_pins.contains(&key) {
                return Err(JoinRefusal::NameTaken { cluster });
            }
            if admission.accepted {
                // The cluster's namespace, where its ManifestWorks go (OCM's registration
                // controller does the same on acceptance).
                self.store.ensure_namespace(&cluster).await?;
                let ca = self.authority.current();
                let (certificate_pem, _) = ca
                    .sign_cluster_csr(&cluster, &request.csr_pem, self.client_cert_lifetime)
                    .map_err(JoinRefusal::Csr)?;
                info!(cluster = %cluster, lifetime = ?self.client_cert_lifetime, "cluster accepted; client certificate issued");
                return Ok(JoinUpdate {
                    state: join_update::State::Accepted.into(),
                    message: format!("cluster {cluster} accepted by the hub"),
                    certificate_pem,
                    ca_bundle_pem: ca.bundle_pem(),
                });
            }
            if !told_pending {
                info!(cluster = %cluster, "join request pending: waiting for `flotilla cluster accept`");
                told_pending = true;
            }
            let pending = JoinUpdate {
                state: join_update::State::Pending.into(),
                message: format!(
                    "join request recorded; waiting for an operator to run `flotilla cluster accept {cluster}`"
                ),
                ..Default::default()
            };
            if updates.send(Ok(pending)).await.is_err() {
                // The agent went away; its request stays recorded for when it comes back.
                return Err(JoinRefusal::Unavailable("the agent disconnected".into()));
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() {
                    return Err(JoinRefusal::Unavailable("the hub is shutting down".into()));
                },
                _ = tokio::time::sleep(PENDING_REMINDER) => {}
            }
        }
    }

    /// Records the request: a new ManagedCluster (spending a token use), a re-attach of the
    /// same key (spending nothing), or a claim of a record an operator created without a key.
    async fn record(&self, request: &JoinRequest, key: &str) -> Result<(), JoinRefusal> {
        let cluster = &request.cluster_name;
        for _ in 0..WRITE_ATTEMPTS {
            match self.store.get(Kind::ManagedCluster, None, cluster).await? {
                Some(mut mc) => {
                    if let Some(reason) = mc["metadata"]["annotations"][DENIED_ANNOTATION].as_str()
                    {
                        return Err(JoinRefusal::Denied {
                            cluster: cluster.clone(),
                            reason: reason.to_string(),
                        });
                    }
                    let pins = key_pins(&mc);
                    if pins.iter().any(|p| p == key) {
                        return Ok(());
                    }
                    if !pins.is_empty() {
                        return Err(JoinRefusal::NameTaken {
                            cluster: cluster.clone(),
                        });
                    }
                    // Pre-created by an operator (kubectl apply) without a key: the first
                    // token holder claims it; acceptance stays as the operator set it.
                    let grant = self.tokens.redeem(&request.token, Use::Spend).await?;
                    annotate(&mut mc, KEY_PINS_ANNOTATION, key);
                    annotate(&mut mc, TOKEN_ANNOTATION, &grant.token_id);
                    annotate(&mut mc, REQUESTED_AT_ANNOTATION, &now());
                    shard_labels::stamp(&mut mc, self.shards);
                    match self.store.update_spec(mc).await {
                        Ok(_) => return Ok(()),
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                None => {
                    let grant = self.tokens.redeem(&request.token, Use::Spend).await?;
                    let mut labels: BTreeMap<String, String> = request
                        .labels
                        .iter()
                        .filter_map(|l| l.split_once('='))
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect();
                    // The token's labels are the hub's word; the agent's are a request.
                    labels.extend(grant.labels.clone());
                    let mut mc = json!({
                        "apiVersion": Kind::ManagedCluster.api_version(),
                        "kind": "ManagedCluster",
                        "metadata": {
                            "name": cluster,
                            "labels": labels,
                            "annotations": {
                                KEY_PINS_ANNOTATION: key,
                                TOKEN_ANNOTATION: grant.token_id,
                                REQUESTED_AT_ANNOTATION: now(),
                            },
                        },
                        "spec": { "hubAcceptsClient": grant.auto_accept, "leaseDurationSeconds": 60 },
                    });
                    shard_labels::stamp(&mut mc, self.shards);
                    match self.store.create(mc).await {
                        Ok(_) => {
                            info!(cluster = %cluster, token = %grant.token_id, auto_accept = grant.auto_accept, "join request recorded");
                            return Ok(());
                        }
                        Err(StoreError::AlreadyExists { .. }) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        Err(JoinRefusal::Unavailable(format!(
            "ManagedCluster {cluster} kept changing under the join; try again"
        )))
    }
}

type JoinStream = Pin<Box<dyn Stream<Item = Result<JoinUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl Registration for JoinService {
    type JoinStream = JoinStream;

    async fn join(&self, request: Request<JoinRequest>) -> Result<Response<JoinStream>, Status> {
        let remote = request
            .extensions()
            .get::<ConnInfo>()
            .map(|i| i.remote.to_string())
            .unwrap_or_default();
        let request = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let this = self.clone();
        tokio::spawn(async move {
            let cluster = request.cluster_name.clone();
            let last = match this.run(request, &tx).await {
                Ok(update) => Ok(update),
                Err(JoinRefusal::Unavailable(detail)) => {
                    warn!(cluster = %cluster, peer = %remote, reason = %detail, "join interrupted");
                    Err(Status::unavailable(detail))
                }
                Err(refusal) => {
                    warn!(cluster = %cluster, peer = %remote, reason = %refusal, "join refused");
                    Ok(JoinUpdate {
                        state: join_update::State::Denied.into(),
                        message: refusal.to_string(),
                        ..Default::default()
                    })
                }
            };
            let _ = tx.send(last).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Renewals over the session, for the hub's in-process gateway.
pub struct HubCertificates {
    store: Arc<dyn Store>,
    authority: Arc<Authority>,
    client_cert_lifetime: Duration,
}

impl HubCertificates {
    pub fn new(
        store: Arc<dyn Store>,
        authority: Arc<Authority>,
        client_cert_lifetime: Duration,
    ) -> Arc<HubCertificates> {
        Arc::new(HubCertificates {
            store,
            authority,
            client_cert_lifetime,
        })
    }
}

#[async_trait]
impl ClusterCertificates for HubCertificates {
    async fn renew(
        &self,
        cluster: &str,
        current_key_sha256: &str,
        csr_pem: &str,
    ) -> Result<RenewedCertificate, RenewalError> {
        let new_key =
            ca::csr_key_sha256(csr_pem).map_err(|e| RenewalError::BadRequest(e.to_string()))?;
        let not_admitted = |reason: &str| RenewalError::NotAdmitted {
            cluster: cluster.to_string(),
            reason: reason.to_string(),
        };
        let unavailable = |e: StoreError| RenewalError::Unavailable(e.to_string());
        let mut recorded = false;
        for _ in 0..WRITE_ATTEMPTS {
            let Some(mut mc) = self
                .store
                .get(Kind::ManagedCluster, None, cluster)
                .await
                .map_err(unavailable)?
            else {
                return Err(not_admitted("it is not registered (deleted)"));
            };
            let admission = ClusterAdmission::from_object(&mc);
            if admission.denied.is_some() || !admission.accepted {
                return Err(not_admitted("it is denied or not accepted"));
            }
            if !admission.key_pins.iter().any(|p| p == current_key_sha256) {
                return Err(not_admitted("the session's key is no longer registered"));
            }
            // Newest first: the new key, then the key of the session asking.
            let pins = [new_key.as_str(), current_key_sha256];
            let mut pins: Vec<&str> = pins.into_iter().collect();
            pins.dedup();
            pins.truncate(MAX_KEY_PINS);
            annotate(&mut mc, KEY_PINS_ANNOTATION, &pins.join(","));
            match self.store.update_spec(mc).await {
                Ok(_) => {
                    recorded = true;
                    break;
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(unavailable(e)),
            }
        }
        if !recorded {
            return Err(RenewalError::Unavailable(format!(
                "ManagedCluster {cluster} kept changing during the renewal"
            )));
        }
        let ca = self.authority.current();
        let (certificate_pem, _) = ca
            .sign_cluster_csr(cluster, csr_pem, self.client_cert_lifetime)
            .map_err(|e| RenewalError::BadRequest(e.to_string()))?;
        Ok(RenewedCertificate {
            certificate_pem,
            ca_bundle_pem: ca.bundle_pem(),
        })
    }

    fn ca_bundle(&self) -> String {
        self.authority.current().bundle_pem()
    }
}

/// What an operator's accept, deny or key registration did.
#[derive(Debug, thiserror::Error)]
pub enum ClusterOpError {
    /// No such ManagedCluster. Not retryable: the agent must ask to join first.
    #[error(
        "cluster {0} has not asked to join (no ManagedCluster of that name): run `flotilla-agent join` on the spoke first"
    )]
    NotFound(String),
    /// The store failed or kept conflicting. Retryable.
    #[error("{0}")]
    Store(#[from] StoreError),
}

/// `flotilla cluster accept`: sets `hubAcceptsClient: true` (and lifts a denial). The waiting
/// agent gets its certificate within moments.
pub async fn accept(store: &dyn Store, cluster: &str) -> Result<Value, ClusterOpError> {
    let accepted = modify(store, cluster, |mc| {
        mc["spec"]["hubAcceptsClient"] = Value::Bool(true);
        if let Some(a) = mc["metadata"]["annotations"].as_object_mut() {
            a.remove(DENIED_ANNOTATION);
        }
    })
    .await?;
    // Where its ManifestWorks go, as OCM's registration controller makes it on acceptance.
    store.ensure_namespace(cluster).await?;
    Ok(accepted)
}

/// `flotilla cluster deny`: sets `hubAcceptsClient: false` with the reason; a waiting agent gets
/// DENIED, a connected one loses its session, and its certificate stops working.
pub async fn deny(store: &dyn Store, cluster: &str, reason: &str) -> Result<Value, ClusterOpError> {
    modify(store, cluster, |mc| {
        mc["spec"]["hubAcceptsClient"] = Value::Bool(false);
        annotate(mc, DENIED_ANNOTATION, reason);
    })
    .await
}

/// `flotilla-hub dev-cert`: registers (creating if needed) an accepted cluster whose agent holds
/// a certificate for key `key_sha256` issued outside the join flow (development only).
pub async fn register_dev_key(
    store: &dyn Store,
    cluster: &str,
    key_sha256: &str,
    shards: u32,
) -> Result<Value, ClusterOpError> {
    let mut mc = json!({
        "apiVersion": Kind::ManagedCluster.api_version(),
        "kind": "ManagedCluster",
        "metadata": { "name": cluster, "annotations": { KEY_PINS_ANNOTATION: key_sha256 } },
        "spec": { "hubAcceptsClient": true, "leaseDurationSeconds": 60 },
    });
    shard_labels::stamp(&mut mc, shards);
    store.ensure_namespace(cluster).await?;
    match store.create(mc).await {
        Ok(created) => return Ok(created),
        Err(StoreError::AlreadyExists { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    modify(store, cluster, |mc| {
        mc["spec"]["hubAcceptsClient"] = Value::Bool(true);
        let mut pins = key_pins(mc);
        pins.retain(|p| p != key_sha256);
        pins.insert(0, key_sha256.to_string());
        pins.truncate(MAX_KEY_PINS);
        annotate(mc, KEY_PINS_ANNOTATION, &pins.join(","));
    })
    .await
}

async fn modify(
    store: &dyn Store,
    cluster: &str,
    change: impl Fn(&mut Value),
) -> Result<Value, ClusterOpError> {
    let mut last = None;
    for _ in 0..WRITE_ATTEMPTS {
        let Some(mut mc) = store.get(Kind::ManagedCluster, None, cluster).await? else {
            return Err(ClusterOpError::NotFound(cluster.to_string()));
        };
        change(&mut mc);
        match store.update_spec(mc).await {
            Ok(updated) => return Ok(updated),
            Err(e @ StoreError::Conflict { .. }) => last = Some(e),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last
        .map(ClusterOpError::Store)
        .unwrap_or_else(|| ClusterOpError::NotFound(cluster.to_string())))
}

fn annotate(mc: &mut Value, key: &str, value: &str) {
    if !mc["metadata"]["annotations"].is_object() {
        mc["metadata"]["annotations"] = json!({});
    }
    mc["metadata"]["annotations"][key] = Value::String(value.to_string());
}

fn now() -> String {
    jiff::Timestamp::now().to_string()
}
