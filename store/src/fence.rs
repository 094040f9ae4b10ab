//! What both backends share of fenced writes: the [`Basis`] a write is compared against and
//! conditioned on, and the checks and refusals around `flotilla_proto::contract::fence`'s rule.
//!
//! A fenced status write sets `status.fence` to the writer's fence; a fenced spec write (a
//! finalizer, a taint) sets the spec-fence annotation instead (a spec write cannot change the
//! status), and both are judged against the newer of the two ([`WriteFence::recorded`]), so a
//! new owner's spec write fences an older owner's status writes. Unfenced writes (the operator
//! API, the hub's controllers) keep the stored records whatever their object says: only a
//! fenced write changes them.

use flotilla_proto::contract::fence::{self, FENCE_FIELD, SPEC_FENCE_ANNOTATION, WriteFence};
use serde_json::Value;

use crate::object::ObjectKey;
use crate::{Object, Revision, StoreError};

/// An object as a fenced writer last saw it: its resourceVersion, which the write is
/// conditioned on, and the fencing record it held then ([`WriteFence::recorded`]), which the
/// write is compared against. The object a write returned is the cheapest basis for the next write of it (no read
/// needed while nobody else wrote it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Basis {
    pub revision: Revision,
    pub fence: Option<WriteFence>,
}

impl Basis {
    /// The basis `object` gives, if it has a resourceVersion.
    pub fn of(object: &Object) -> Option<Basis> {
        Some(Basis {
            revision: Revision::of(object)?,
            fence: WriteFence::recorded(object),
        })
    }
}

/// Refuses a fenced write of a kind whose status has no fencing record.
pub(crate) fn check_kind(key: &ObjectKey) -> Result<(), StoreError> {
    if fence::is_fenced(key.kind) {
        return Ok(());
    }
    Err(key.invalid(format!(
        "{} has no fencing record in its status: fenced writes are for {}",
        key.kind,
        fence::FENCED_KINDS.map(|k| k.name()).join(", ")
    )))
}

/// The rule applied to a write under `attempted` of `key`, whose record is `stored`.
pub(crate) fn judge(
    key: &ObjectKey,
    attempted: &WriteFence,
    stored: Option<&WriteFence>,
) -> Result<(), StoreError> {
    fence::judge(attempted, stored).map_err(|reason| StoreError::Fenced {
        kind: key.kind,
        namespace: key.namespace.clone(),
        name: key.name.clone(),
        reason,
        attempted: Box::new(attempted.clone()),
        stored: Box::new(stored.cloned().unwrap_or_default()),
    })
}

/// Makes an unfenced writer's `status` of `key` carry the record `stored` holds (or none), so
/// that only fenced writes change it.
pub(crate) fn keep_stored(key: &ObjectKey, status: &mut Value, stored: Option<&Object>) {
    if !fence::is_fenced(key.kind) {
        return;
    }
    let Some(map) = status.as_object_mut() else {
        return;
    };
    match stored.and_then(|o| o.pointer(&format!("/status/{FENCE_FIELD}"))) {
        Some(record) => map.insert(FENCE_FIELD.to_owned(), record.clone()),
        None => map.remove(FENCE_FIELD),
    };
}

/// Makes an unfenced writer's `object` of `key` carry the spec-fence annotation `stored` holds
/// (or none), so that only fenced spec writes change it.
pub(crate) fn keep_stored_spec_record(key: &ObjectKey, object: &mut Value, stored: &Object) {
    if !fence::is_fenced(key.kind) {
        return;
    }
    let record = stored
        .get("metadata")
        .and_then(|m| m.get("annotations"))
        .and_then(|a| a.get(SPEC_FENCE_ANNOTATION))
        .cloned();
    let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    match record {
        Some(record) => {
            let annotations = meta
                .entry("annotations")
                .or_insert_with(|| Value::Object(Default::default()));
            if !annotations.is_object() {
                *annotations = Value::Object(Default::default());
            }
            if let Some(map) = annotations.as_object_mut() {
                map.insert(SPEC_FENCE_ANNOTATION.to_owned(), record);
            }
        }
        None => {
            if let Some(map) = meta.get_mut("annotations").and_then(Value::as_object_mut) {
                map.remove(SPEC_FENCE_ANNOTATION);
            }
        }
    }
}
