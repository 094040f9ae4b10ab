//! What the cache stores about each work: the work as held, the resources it applied, and its
//! latest status with how far the hub has acknowledged it.

use std::fmt;

use flotilla_proto::wire::HeldWork;
use serde::{Deserialize, Serialize};

/// Largest ManifestWork (as the hub's JSON) the agent keeps. A bigger one is refused: the cache
/// records the refusal instead of the content, and the status says so. The hub's own bound on
/// manifests is 500 KiB of compact JSON; this leaves room for metadata and for a hub that is
/// newer than this agent, while keeping one work's memory bounded.
pub const MAX_MANIFEST_WORK_BYTES: usize = 2 * 1024 * 1024;

/// One work as the agent holds it, without its content (see [`WorkCache::manifest_work`]), so
/// listing works for a hello or a resync never loads every manifest.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct CachedWork {
    /// The ManifestWork's `metadata.uid` on the hub: the key of everything here.
    pub uid: String,
    /// The hub namespace (the cluster's name), for logs and messages.
    pub namespace: String,
    /// The ManifestWork's name, for logs and messages.
    pub name: String,
    /// `metadata.generation` of the spec held.
    pub generation: i64,
    /// The hub's content hash of that spec, echoed in the hello so a resume sends only what
    /// differs.
    pub content_hash: String,
    /// Set when the agent would not keep the content (too large, not a ManifestWork); the
    /// reason goes into the work's status. The generation is still held and acked, so the hub
    /// does not resend the same content on every reconnect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// The hub deleted the work. It stays, as a tombstone, until its resources are deleted or
    /// orphaned as its deleteOption says; then it is forgotten.
    #[serde(default)]
    pub deleting: bool,
    /// One of the cluster's governance Policies rather than a ManifestWork: the governor
    /// evaluates and enforces it, the reconciler never applies it. Its status is its
    /// compliance on this cluster.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub policy: bool,
}

impl CachedWork {
    /// `namespace/name`, as people write it.
    pub fn display_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// What the hello says about this work.
    pub fn held(&self) -> HeldWork {
        HeldWork {
            uid: self.uid.clone(),
            generation: self.generation,
            content_hash: self.content_hash.clone(),
        }
    }
}

/// One resource a work applied, as the ledger remembers it for deletion and orphaning.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AppliedResource {
    /// API group; empty for the core group.
    pub group: String,
    /// API version, e.g. `v1`.
    pub version: String,
    /// Kind, e.g. `Deployment`.
    pub kind: String,
    /// Resource (plural, lower-case), e.g. `deployments`.
    pub resource: String,
    /// Namespace; empty for cluster-scoped resources.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl AppliedResource {
    /// `apiVersion` as written in manifests: `apps/v1`, or `v1` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

impl fmt::Display for AppliedResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ", self.api_version(), self.kind)?;
        if !self.namespace.is_empty() {
            write!(f, "{}/", self.namespace)?;
        }
        f.write_str(&self.name)
    }
}

/// The latest status the agent produced for a work, and how far the hub has acknowledged it.
/// It stays after the ack: the next status is compared with it, so an unchanged status is
/// never produced twice, and its seq keeps counting up across restarts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StatusRecord {
    /// The work generation the status was computed for.
    pub generation: i64,
    /// This status's seq; every new status of the work gets the next one.
    pub seq: u64,
    /// The highest seq the hub acknowledged; the status is pending while `acked_seq < seq`.
    pub acked_seq: u64,
    /// The ManifestWork status (conditions, resourceStatus).
    pub status: serde_json::Value,
}

impl StatusRecord {
    /// Whether the hub has yet to acknowledge this status.
    pub fn is_pending(&self) -> bool {
        self.acked_seq < self.seq
    }
}

/// A status the hub has not acknowledged, ready for `report_status`.
#[derive(Clone, Debug, PartialEq)]
pub struct PendingStatus {
    /// The work's uid.
    pub uid: String,
    /// The generation it was computed for.
    pub generation: i64,
    /// Its seq.
    pub seq: u64,
    /// The status as JSON.
    pub status_json: Vec<u8>,
}
