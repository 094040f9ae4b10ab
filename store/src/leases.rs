//! flotilla's coordination.k8s.io/v1 Leases on the hub apiserver: shard leases
//! (`flotilla-shard-NN`, one per virtual shard, held by the gateway that serves it) and gateway
//! leases (`flotilla-gateway-NAME`, each gateway's announcement with its advertised address).
//!
//! Only the IO lives here, as plain records in and out: every write carries the resourceVersion
//! it was decided on (or is a create), so two gateways that decide to claim the same lease
//! cannot both succeed; the loser gets [`LeaseError::Conflict`]. What to claim, renew or
//! release, and when a lease counts as expired, is decided elsewhere (the gateway's
//! `ShardOwner`) from these records and the local clock.

use std::time::Duration;

use flotilla_proto::contract::{ADVERTISE_ADDRESS_ANNOTATION, LEASE_ROLE_LABEL};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, ListParams, PostParams};

/// One Lease as flotilla reads and writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    /// `metadata.name`: `flotilla-shard-NN` or `flotilla-gateway-NAME`.
    pub name: String,
    /// `metadata.labels[flotilla.io/lease]`: `shard` or `gateway`.
    pub role: String,
    /// `spec.holderIdentity`; `None` (or empty) when released.
    pub holder: Option<String>,
    /// `spec.leaseDurationSeconds`.
    pub duration: Duration,
    /// `spec.leaseTransitions`: the fencing epoch, bumped by every claim that changes the
    /// holder.
    pub transitions: u32,
    /// `spec.renewTime` as written (RFC 3339); it only tells readers that the holder is alive
    /// (it changed), never compared with their own clock.
    pub renewed: Option<String>,
    /// `metadata.resourceVersion`; `None` for a lease that does not exist yet (the write
    /// creates it).
    pub resource_version: Option<String>,
    /// The holder's advertised host:port (gateway leases).
    pub address: Option<String>,
}

impl LeaseRecord {
    /// The holder, if held (an empty holder is a released lease).
    pub fn holder(&self) -> Option<&str> {
        self.holder.as_deref().filter(|h| !h.is_empty())
    }
}

/// Why a lease call failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Someone else wrote the lease since it was read (or created it first). Not retryable as
    /// is: read the leases again and decide again.
    #[error("Lease {namespace}/{name} changed since it was read (another gateway wrote it)")]
    Conflict { namespace: String, name: String },
    /// The apiserver could not be reached or refused the call. Retryable at the next renewal;
    /// the message says what was being done.
    #[error("Lease {namespace}/{name}: {doing} failed: {source}")]
    Backend {
        namespace: String,
        name: String,
        doing: &'static str,
        #[source]
        source: kube::Error,
    },
}

/// The Leases of one namespace of the hub apiserver. Cheap to clone.
#[derive(Clone)]
pub struct KubeLeases {
    client: Client,
    namespace: String,
}

impl KubeLeases {
    pub fn new(client: Client, namespace: impl Into<String>) -> KubeLeases {
        KubeLeases {
            client,
            namespace: namespace.into(),
        }
    }

    /// The namespace the leases live in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn api(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn error(&self, name: &str, doing: &'static str, source: kube::Error) -> LeaseError {
        if let kube::Error::Api(status) = &source
            && status.code == 409
        {
            return LeaseError::Conflict {
                namespace: self.namespace.clone(),
                name: name.to_string(),
            };
        }
        LeaseError::Backend {
            namespace: self.namespace.clone(),
            name: name.to_string(),
            doing,
            source,
        }
    }

    /// Creates the namespace if it does not exist (one that exists, or a refusal to create it
    /// when it does, is fine: the lease calls then say what is wrong).
    pub async fn ensure_namespace(&self) {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let _ = namespaces.create(&PostParams::default(), &ns).await;
    }

    /// Every flotilla lease of the namespace (shard and gateway leases), in one request.
    pub async fn list(&self) -> Result<Vec<LeaseRecord>, LeaseError> {
        let params = ListParams::default().labels(LEASE_ROLE_LABEL);
        let leases = self
            .api()
            .list(&params)
            .await
            .map_err(|e| self.error("*", "listing", e))?;
        Ok(leases.items.into_iter().map(from_lease).collect())
    }

    /// Writes `record` as decided: creates it when it has no resourceVersion, else replaces
    /// it only if the stored resourceVersion is still that one. `renewTime` is set to now
    /// (held leases), and `acquireTime` too when `acquired` (a claim). Returns the lease as
    /// stored.
    pub async fn write(
        &self,
        record: &LeaseRecord,
        acquired: bool,
    ) -> Result<LeaseRecord, LeaseError> {
        let now = MicroTime(jiff::Timestamp::now());
        let held = record.holder().is_some();
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(record.name.clone()),
                namespace: Some(self.namespace.clone()),
                resource_version: record.resource_version.clone(),
                labels: Some([(LEASE_ROLE_LABEL.to_string(), record.role.clone())].into()),
                annotations: record
                    .address
                    .as_ref()
                    .map(|a| [(ADVERTISE_ADDRESS_ANNOTATION.to_string(), a.clone())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: record.holder.clone().filter(|h| !h.is_empty()),
                lease_duration_seconds: Some(record.duration.as_secs().max(1) as i32),
                lease_transitions: Some(record.transitions as i32),
                renew_time: held.then(|| now.clone()),
                acquire_time: (held && acquired).then_some(now),
                ..LeaseSpec::default()
            }),
        };
        let api = self.api();
        let stored = match &record.resource_version {
            None => api
                .create(&PostParams::default(), &lease)
                .await
                .map_err(|e| self.error(&record.name, "creating", e))?,
            Some(_) => api
                .replace(&record.name, &PostParams::default(), &lease)
                .await
                .map_err(|e| self.error(&record.name, "replacing", e))?,
        };
        Ok(from_lease(stored))
    }
}

fn from_lease(lease: Lease) -> LeaseRecord {
    let spec = lease.spec.unwrap_or_default();
    let meta = lease.metadata;
    LeaseRecord {
        name: meta.name.unwrap_or_default(),
        role: meta
            .labels
            .and_then(|mut l| l.remove(LEASE_ROLE_LABEL))
            .unwrap_or_default(),
        holder: spec.holder_identity.filter(|h| !h.is_empty()),
        duration: Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64),
        transitions: spec.lease_transitions.unwrap_or(0).max(0) as u32,
        renewed: spec.renew_time.map(|t| t.0.to_string()),
        resource_version: meta.resource_version,
        address: meta
            .annotations
            .and_then(|mut a| a.remove(ADVERTISE_ADDRESS_ANNOTATION)),
    }
}
