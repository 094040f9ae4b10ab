//! The calls the apply engine makes to a cluster ([`ApplyTarget`]), what they answer, and how a
//! manifest that could not be applied says so in its status. The real target is the spoke's
//! kube-apiserver (`kube`), the simulated one an in-memory cluster (`memory`).

use std::fmt;

use async_trait::async_trait;
use futures::stream::BoxStream;
use serde_json::Value;

use crate::cache::AppliedResource;

/// The field manager of every server-side apply the agent makes.
pub const FIELD_MANAGER: &str = "flotilla-agent";

/// What a kind resolves to on the spoke.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceKind {
    /// API group; empty for the core group.
    pub group: String,
    /// API version.
    pub version: String,
    /// Kind.
    pub kind: String,
    /// Resource (plural, lower-case).
    pub resource: String,
    /// Whether objects of this kind live in a namespace.
    pub namespaced: bool,
}

/// What a delete achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deletion {
    /// The object is gone (or was never there).
    Gone,
    /// The object is terminating and waits for its finalizers; ask again later.
    Terminating,
}

/// Why a call to the spoke failed. The message is what a person sees in the work's status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// The spoke apiserver refused the request; `message` is its own, verbatim. Retryable only
    /// for conflicts, throttling and server errors (see [`ApplyError::is_retryable`]).
    #[error("{message}")]
    Rejected {
        /// HTTP status code.
        code: u16,
        /// The apiserver's machine-readable reason, e.g. `Invalid`.
        reason: String,
        /// The apiserver's message.
        message: String,
    },
    /// The spoke serves no such kind (unknown group, version or kind). Retryable: a CRD
    /// applied just before may not be served yet.
    #[error("the spoke cluster serves no kind {kind} in {api_version}: {detail}")]
    UnknownKind {
        /// The manifest's apiVersion.
        api_version: String,
        /// The manifest's kind.
        kind: String,
        /// What discovery said.
        detail: String,
    },
    /// The spoke apiserver could not be reached or answered nonsense. Retryable.
    #[error("cannot reach the spoke apiserver: {0}")]
    Unreachable(String),
    /// A list found more objects than the caller's bound. Not retryable until objects go.
    #[error(
        "the spoke cluster has more than {limit} {resource}{location}, more than one read may hold"
    )]
    TooMany {
        /// The resource listed, e.g. `configmaps`.
        resource: String,
        /// ` in namespace x`, or empty for a cluster-wide list.
        location: String,
        /// The bound.
        limit: usize,
    },
}

impl ApplyError {
    /// Whether trying again later, without a change to the work, may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            ApplyError::Rejected { code, .. } => matches!(code, 409 | 429 | 500..),
            ApplyError::UnknownKind { .. } | ApplyError::Unreachable(_) => true,
            ApplyError::TooMany { .. } => false,
        }
    }
}

/// A change to an object of a watched kind.
#[derive(Clone, Debug, PartialEq)]
pub enum ObjectEvent {
    /// The object is now this (created, changed, or listed when the watch (re)started).
    Changed(Value),
    /// The object is gone.
    Deleted {
        /// Its namespace; empty for cluster-scoped objects.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// The watch (re)listed the kind: every object there now came as `Changed` before this.
    /// An object deleted while the watch was not yet (or not) running sends nothing, so a
    /// reader that must not miss deletions reads again on this.
    Listed,
}

/// One question to the spoke's authorizer: may `user` (in `groups`) do `verb` on this object?
/// A SubjectAccessReview on a real spoke.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessCheck {
    /// e.g. `system:serviceaccount:team-a:deployer`.
    pub user: String,
    /// The user's groups, as the apiserver would authenticate them.
    pub groups: Vec<String>,
    /// e.g. `create`.
    pub verb: String,
    /// The object.
    pub resource: AppliedResource,
}

/// The calls the apply engine makes to a cluster. Object-safe so that the agent holds an
/// `Arc<dyn ApplyTarget>`: the real spoke, or a simulated one in the load-test.
#[async_trait]
pub trait ApplyTarget: Send + Sync + fmt::Debug {
    /// Which resource `kind` of `api_version` is, and whether it is namespaced.
    async fn resolve(&self, api_version: &str, kind: &str) -> Result<ResourceKind, ApplyError>;

    /// Server-side applies `manifest` as `resource` (whose namespace is already settled) with
    /// `field_manager`, taking over conflicting fields when `force`; returns the object stored.
    async fn apply(
        &self,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
        force: bool,
    ) -> Result<Value, ApplyError>;

    /// Creates the object as `field_manager`; 409 `AlreadyExists` if it is there.
    async fn create(
        &self,
        resource: &AppliedResource,
        object: &Value,
        field_manager: &str,
    ) -> Result<Value, ApplyError>;

    /// Replaces the object (an update call) as `field_manager`; 409 `Conflict` when its
    /// `metadata.resourceVersion` is not the stored one.
    async fn replace(
        &self,
        resource: &AppliedResource,
        object: &Value,
        field_manager: &str,
    ) -> Result<Value, ApplyError>;

    /// The object, if present.
    async fn get(&self, resource: &AppliedResource) -> Result<Option<Value>, ApplyError>;

    /// Every object of `kind` in `namespace` (cluster-wide when `None`), each with its
    /// `apiVersion` and `kind` set; [`ApplyError::TooMany`] when there are more than `limit`,
    /// so that one read can never hold a whole cluster in memory.
    async fn list(
        &self,
        kind: &ResourceKind,
        namespace: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Value>, ApplyError>;

    /// Whether the object exists.
    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError>;

    /// Deletes the object; its dependents are left to the spoke's garbage collector.
    async fn delete(&self, resource: &AppliedResource) -> Result<Deletion, ApplyError>;

    /// Asks the spoke's authorizer one question (a SubjectAccessReview).
    async fn review_access(&self, check: &AccessCheck) -> Result<bool, ApplyError>;

    /// Server-side applies `manifest` as `resource` in dry-run mode (`dryRun=All`: nothing is
    /// stored) as `user`, impersonated, so that the spoke's own admission decides as it would
    /// for that user: for RBAC objects, the apiserver's escalation check (a Role may grant only
    /// rights its writer holds). A refusal is the apiserver's error.
    async fn dry_run_as(
        &self,
        user: &str,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
    ) -> Result<(), ApplyError>;

    /// Every change to objects of `kind`, starting with the objects there now. The stream
    /// re-lists and resumes by itself after errors and never ends while the cluster lives.
    fn watch(&self, kind: &ResourceKind) -> BoxStream<'static, ObjectEvent>;
}

/// The reason of a manifest's `Applied=False` condition when nothing more specific applies.
pub const REASON_APPLY_FAILED: &str = "AppliedManifestFailed";
/// The reason when a server-side apply met fields another field manager owns (OCM's).
pub const REASON_APPLY_CONFLICT: &str = "ApplyConflict";
/// The reason when `ignoreFields` cannot be used (OCM's).
pub const REASON_IGNORE_FIELD_ERROR: &str = "AppliedManifestSSAIgnoreFieldError";

/// Why one manifest was not applied, as its status shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestFailure {
    /// The spoke's message verbatim, or what is wrong with the manifest.
    pub message: String,
    /// Whether a retry without a change to the work may succeed.
    pub retryable: bool,
    /// The reason of the manifest's `Applied=False` condition.
    pub reason: &'static str,
}

impl ManifestFailure {
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: false,
            reason: REASON_APPLY_FAILED,
        }
    }
}

impl From<ApplyError> for ManifestFailure {
    fn from(e: ApplyError) -> Self {
        Self {
            retryable: e.is_retryable(),
            message: e.to_string(),
            reason: REASON_APPLY_FAILED,
        }
    }
}

/// `apps/v1` → (`apps`, `v1`); `v1` → (``, `v1`).
pub(super) fn split_api_version(api_version: &str) -> (String, String) {
    match api_version.split_once('/') {
        Some((group, version)) => (group.to_owned(), version.to_owned()),
        None => (String::new(), api_version.to_owned()),
    }
}
