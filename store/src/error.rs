//! The one error type every backend returns.

use flotilla_proto::api::Kind;
use flotilla_proto::contract::fence::{Stale, WriteFence};

use crate::Revision;

/// The underlying error of a backend failure (kube's, sled's, serde's, or a sentence when the
/// backend answered something it should not have), kept so that logs can say the whole cause.
pub type BackendCause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong in a store call. Each variant says whether retrying can help; messages name
/// the object ("ManifestWork store-7/baseline not found") so they can be shown to a person as is.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The object does not exist. Not retryable as is: create it, or treat it as gone.
    #[error("{kind} {} not found", display_key(.namespace.as_deref(), .name))]
    NotFound {
        kind: Kind,
        namespace: Option<String>,
        name: String,
    },

    /// An object of this kind and name exists already. Not retryable: get or update it instead.
    #[error("{kind} {} already exists", display_key(.namespace.as_deref(), .name))]
    AlreadyExists {
        kind: Kind,
        namespace: Option<String>,
        name: String,
    },

    /// The object changed since the caller read it (its resourceVersion is stale). Retryable after
    /// getting the object again and reapplying the change.
    #[error("{kind} {}: {reason}", display_key(.namespace.as_deref(), .name))]
    Conflict {
        kind: Kind,
        namespace: Option<String>,
        name: String,
        reason: String,
    },

    /// A watch asked for events from a revision the store no longer holds (kube's 410 Gone).
    /// Retryable by listing again and watching from the list's revision; never by repeating the
    /// same watch.
    #[error(
        "watch from revision {from} is no longer available: list again and watch from the list's revision"
    )]
    Gone { from: Revision },

    /// The object or request is malformed: no name, a kind or apiVersion the store does not hold,
    /// a namespace on a cluster-scoped kind, too large, or refused by the apiserver's validation.
    /// Not retryable: fix the object. `kind` is the kind as given, which may be no stored kind.
    #[error("{kind} {}: {reason}", display_key(.namespace.as_deref(), .name))]
    Invalid {
        kind: String,
        namespace: Option<String>,
        name: String,
        reason: String,
    },

    /// A fenced write refused: the object's fencing record is newer than the write's (another
    /// gateway wrote it under a newer epoch of the shard, or a newer report of the agent is
    /// stored; see `flotilla_proto::contract::fence`). Not retryable: the write is stale for
    /// good, and repeating it changes nothing; drop it.
    #[error(
        "{kind} {}: {reason} write refused: it was made under {attempted}, and the object holds \
         {stored}",
        display_key(.namespace.as_deref(), .name)
    )]
    Fenced {
        kind: Kind,
        namespace: Option<String>,
        name: String,
        reason: Stale,
        /// The fence the refused write was made under.
        attempted: Box<WriteFence>,
        /// The record the object holds, written by the gateway it names.
        stored: Box<WriteFence>,
    },

    /// IO or apiserver trouble (disk, connection, timeout, 5xx). Retryable with backoff; the
    /// write may or may not have happened, so read before assuming either.
    #[error("store backend failed while {context}: {source}")]
    Backend {
        context: String,
        #[source]
        source: BackendCause,
    },
}

impl StoreError {
    /// True when the same call may succeed if simply repeated later (with backoff).
    /// `Conflict` and `Gone` are recoverable too, but only by reading again first.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Backend { .. })
    }

    pub(crate) fn backend(context: impl Into<String>, source: impl Into<BackendCause>) -> Self {
        StoreError::Backend {
            context: context.into(),
            source: source.into(),
        }
    }

    pub(crate) fn invalid(
        kind: impl Into<String>,
        namespace: Option<&str>,
        name: &str,
        reason: impl Into<String>,
    ) -> Self {
        StoreError::Invalid {
            kind: kind.into(),
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
            reason: reason.into(),
        }
    }
}

/// `namespace/name` for namespaced objects, `name` for cluster-scoped ones.
pub(crate) fn display_key(namespace: Option<&str>, name: &str) -> String {
    let name = if name.is_empty() { "(no name)" } else { name };
    match namespace {
        Some(ns) if !ns.is_empty() => format!("{ns}/{name}"),
        _ => name.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_object() {
        let cases = [
            (
                StoreError::NotFound {
                    kind: Kind::ManifestWork,
                    namespace: Some("store-7".into()),
                    name: "baseline".into(),
                },
                "ManifestWork store-7/baseline not found",
            ),
            (
                StoreError::AlreadyExists {
                    kind: Kind::ManagedCluster,
                    namespace: None,
                    name: "store-7".into(),
                },
                "ManagedCluster store-7 already exists",
            ),
            (
                StoreError::invalid(
                    "ManifestWork",
                    Some("store-7"),
                    "",
                    "metadata.name is required",
                ),
                "ManifestWork store-7/(no name): metadata.name is required",
            ),
            (
                StoreError::Fenced {
                    kind: Kind::ManifestWork,
                    namespace: Some("store-7".into()),
                    name: "baseline".into(),
                    reason: Stale::Epoch,
                    attempted: Box::new(WriteFence::new(3, 1, "gw-a").with_report(41)),
                    stored: Box::new(WriteFence::new(3, 2, "gw-b").with_report(40)),
                },
                "ManifestWork store-7/baseline: stale_epoch write refused: it was made under \
                 shard 3 epoch 1 by gateway \"gw-a\", report 41, and the object holds shard 3 \
                 epoch 2 by gateway \"gw-b\", report 40",
            ),
            (
                StoreError::Gone {
                    from: Revision::new("12"),
                },
                "watch from revision 12 is no longer available: list again and watch from the list's revision",
            ),
        ];
        for (err, want) in cases {
            assert_eq!(err.to_string(), want);
        }
    }

    #[test]
    fn only_backend_errors_are_blindly_retryable() {
        assert!(StoreError::backend("listing", "connection reset").is_retryable());
        assert!(
            !StoreError::Gone {
                from: Revision::new("1")
            }
            .is_retryable()
        );
    }
}
