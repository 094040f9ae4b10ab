//! The hub's source of truth behind one trait.
//!
//! [`Store`] holds the OCM objects the hub works on (ManagedCluster, ManifestWork, Placement, …)
//! as JSON, keyed by kind, namespace and name, with kube's semantics: a `resourceVersion` on
//! every write, `generation` that follows the spec, status written separately, optimistic
//! concurrency, and list + watch from a revision with `Gone` when the history is too old.
//! Two backends implement it and pass the same conformance suite (`conformance`, behind the
//! feature of that name):
//!
//! * [`SledStore`] — an embedded sled database for the single-node hub (nothing to install);
//! * [`KubeStore`] — the OCM CRDs on a real kube-apiserver, for hubs that scale out.
//!
//! Gateways' writes for a cluster are *fenced* ([`Store::update_status_fenced`],
//! [`Store::update_spec_fenced`]): each carries the writer's [`WriteFence`] (shard, lease epoch,
//! gateway, report sequence), and the store refuses one the object's stored record makes stale
//! ([`StoreError::Fenced`]), comparing and writing in one step, so a gateway that stalled
//! between its own check and the write never lands it over a newer owner's.
//!
//! For: controllers, gateways and the operator API reading and writing hub state, one code path
//! for both modes, and the one list-then-watch loop ([`reflect`]) every watch cache runs on. Also, beside the trait, the
//! coordination Leases shard ownership is decided on (`leases`: their IO only) and
//! [`connect`], the hub apiserver client every scale-out process builds from a kubeconfig.
//! Not for: the agent's local cache (it never links hub code), deciding shard ownership (the
//! gateway's), or business rules (validating a ManifestWork's
//! manifests is proto's and the hub's job; the store checks only what any object needs).
//! Callers work on JSON objects, or on `flotilla_proto::api` types through [`StoreExt`].

#![forbid(unsafe_code)]

mod apiserver;
mod embedded;
mod error;
mod fence;
pub mod leases;
mod object;
pub mod reflect;
mod selection;
mod typed;

#[cfg(feature = "conformance")]
pub mod conformance;

use async_trait::async_trait;
use flotilla_proto::api::Kind;
use futures::stream::BoxStream;

pub use apiserver::{ConnectError, DEFAULT_WATCH_TIMEOUT_SECS, KubeStore, connect};
pub use embedded::{DEFAULT_EVENT_BUFFER, DEFAULT_LIVE_BUFFER, SledOptions, SledStore};
pub use error::{BackendCause, StoreError};
pub use fence::Basis;
pub use flotilla_proto::contract::fence::{Stale, WriteFence};
pub use object::{
    MAX_OBJECT_BYTES, Object, ObjectList, Revision, WatchEvent, generation_of, name_of,
    namespace_of, resource_version,
};
pub use selection::{Selection, label};
pub use typed::StoreExt;

/// A stream of changes. It yields at most one error and ends after it; `Gone` means list again
/// and watch from the list's revision.
pub type WatchStream = BoxStream<'static, Result<WatchEvent, StoreError>>;

/// The hub's source of truth: OCM objects by kind, namespace and name, with kube's semantics.
///
/// `namespace` arguments are `None` for cluster-scoped kinds and required for namespaced kinds,
/// except in `list` and `watch`, where `None` means all namespaces. Every call validates its
/// input at this boundary and refuses bad input with [`StoreError::Invalid`] without touching
/// what is stored.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// The object, or `None` if there is none.
    async fn get(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Object>, StoreError>;

    /// The object as JSON, or `None` if there is none: what [`Store::get`] returns, as bytes
    /// to send on. A backend that keeps the stored JSON answers with it as it is; parsing it
    /// into a `Value` and serialising that again is most of what a read of a large object
    /// costs (a root Policy reaching 10,000 clusters is half a megabyte of small maps).
    async fn get_json(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let Some(object) = self.get(kind, namespace, name).await? else {
            return Ok(None);
        };
        serde_json::to_vec(&object).map(Some).map_err(|e| {
            StoreError::backend(
                format!("serialising {kind} {}", error::display_key(namespace, name)),
                e,
            )
        })
    }

    /// Every object of `kind` in `namespace` (or all namespaces), and the revision to watch from.
    async fn list(&self, kind: Kind, namespace: Option<&str>) -> Result<ObjectList, StoreError>;

    /// Changes to objects of `kind` in `namespace` (or all namespaces) after `from`, exclusive,
    /// in revision order. `from = None` starts with a synthetic `Added` for every current object,
    /// then live changes. A `from` older than the store's history gives [`StoreError::Gone`],
    /// either here or as the stream's error.
    async fn watch(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError>;

    /// Every object of `kind` in all namespaces that `selection` picks, and the revision to
    /// watch from (`labelSelector` on the apiserver).
    async fn list_selected(
        &self,
        kind: Kind,
        selection: &Selection,
    ) -> Result<ObjectList, StoreError>;

    /// [`Store::watch`] of all namespaces through `selection`, with the apiserver's rules: an
    /// object that comes to match arrives as `Added`, one that stops matching (its label
    /// changed) as `Deleted` (carrying the labels it last matched with), and objects outside the selection before and after a change are
    /// never mentioned.
    async fn watch_selected(
        &self,
        kind: Kind,
        selection: &Selection,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError>;

    /// Stores a new object and returns it as stored: with `uid`, `creationTimestamp`,
    /// `generation` 1 and `resourceVersion` set, and without `status` (status is written with
    /// [`Store::update_status`] only, as on an apiserver with the status subresource).
    async fn create(&self, object: Object) -> Result<Object, StoreError>;

    /// Replaces everything but `status` (which is kept as stored). `generation` goes up by one
    /// only when something outside metadata and status changed. If `metadata.resourceVersion` is
    /// set it must be the stored one ([`StoreError::Conflict`] otherwise); if not, the last
    /// writer wins.
    async fn update_spec(&self, object: Object) -> Result<Object, StoreError>;

    /// Replaces `status` (a JSON map) and nothing else: `generation` and spec stay. With
    /// `expected`, the stored resourceVersion must match it ([`StoreError::Conflict`] otherwise).
    /// The fencing record of a fenced kind's status (`status.fence`, see [`WriteFence`]) stays
    /// as stored, whatever `status` says of it: only [`Store::update_status_fenced`] changes it.
    /// On the kube backend that costs a fenced kind's write a read first.
    async fn update_status(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status: serde_json::Value,
        expected: Option<&Revision>,
    ) -> Result<Object, StoreError>;

    /// A gateway's write of a fenced kind's status (ManagedCluster, ManifestWork) under
    /// `fence`: refused with [`StoreError::Fenced`] when the object's stored record makes it
    /// stale (`flotilla_proto::contract::fence::judge`), otherwise `status` replaces the
    /// stored one with `status.fence` set to `fence`. The compare and the write are one step:
    /// on the kube backend the write is conditioned on the resourceVersion of the `basis` the
    /// rule was applied to (the object as the caller last saw it); without a basis, or when the
    /// object changed since it, the object is read again and the rule applied again, a bounded
    /// number of times ([`StoreError::Conflict`] beyond). On sled both happen under the lock
    /// every write takes, and the basis is not needed. [`StoreError::NotFound`] when there is
    /// no such object.
    async fn update_status_fenced(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status: serde_json::Value,
        fence: &WriteFence,
        basis: Option<&Basis>,
    ) -> Result<Object, StoreError>;

    /// [`Store::update_spec`] of a fenced kind under `fence` (a cleanup finalizer, the
    /// unreachable taint): refused with [`StoreError::Fenced`] when the object's fencing record
    /// makes it stale. The record is compared, never raised: a spec write leaves `status`,
    /// and so the epoch an older owner is measured by, as stored. With
    /// `metadata.resourceVersion` set, the rule is applied to `object`'s own `status.fence`
    /// (as the caller read it) and the write conditioned on that version
    /// ([`StoreError::Conflict`] if it changed: the caller redoes its change on a fresh read);
    /// without it, the object is read, compared and replaced on the version read, as
    /// [`Store::update_spec`] does.
    async fn update_spec_fenced(
        &self,
        object: Object,
        fence: &WriteFence,
    ) -> Result<Object, StoreError>;

    /// Deletes the object; [`StoreError::NotFound`] if there is none.
    async fn delete(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<(), StoreError>;

    /// Makes sure a namespace exists, as OCM's registration controller does for each accepted
    /// cluster, so that `kubectl apply` of a ManifestWork into it works on the kube backend.
    /// Backends whose namespaces are implicit (sled) do nothing.
    async fn ensure_namespace(&self, name: &str) -> Result<(), StoreError>;
}
