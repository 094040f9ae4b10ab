//! Fencing the store enforces: the record a gateway's write leaves on the object it writes, and
//! the one rule by which a later write is refused.
//!
//! A gateway acts for a shard while it holds the shard's lease, at the lease's epoch
//! (`leaseTransitions` when it claimed it). Its own clock check before a write is no guarantee:
//! a gateway stalled between that check and the write (a long pause, a slow apiserver round
//! trip, a partition that heals) would land its write after another gateway took the shard.
//! So every fenced write (cluster health and cluster info, work status, the cleanup finalizer,
//! the unreachable taint) carries its [`WriteFence`], a status write stores it in the object's
//! `status.fence` ([`FENCE_FIELD`]), and the store refuses a write the stored record makes
//! stale ([`judge`]), comparing and writing in one step (a resourceVersion precondition on the
//! kube backend, one transaction on sled).
//!
//! Why in the status and not an annotation: the CRDs have the status subresource, and the
//! apiserver keeps all metadata as stored on a `/status` write, so an annotation could only be
//! raised by a second write per status. A spec write (the cleanup finalizer, the taint) cannot
//! change the status for the same reason, so it leaves its fence in an annotation instead
//! ([`SPEC_FENCE_ANNOTATION`]); a write is judged against the newer of the two
//! ([`WriteFence::recorded`]), so a spec write by a shard's new owner fences the old owner's
//! status writes as a status write would.
//!
//! The store, the gateway and the chaos checker all apply this rule; it is written once, here.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::api::Kind;

/// The field of a fenced kind's `status` that holds the [`WriteFence`] of its last fenced write.
pub const FENCE_FIELD: &str = "fence";

/// The annotation holding the [`WriteFence`] (as JSON, without a report sequence) of the last
/// fenced spec write of the object. Written by the store on fenced spec writes only; other
/// writers' spec writes keep it as stored.
pub const SPEC_FENCE_ANNOTATION: &str = "flotilla.io/spec-fence";

/// The kinds whose status carries a [`WriteFence`]: the ones gateways write for the clusters of
/// the shards they hold.
pub const FENCED_KINDS: [Kind; 3] = [
    Kind::ManagedCluster,
    Kind::ManifestWork,
    Kind::ClusterCompliance,
];

/// Whether `kind`'s status carries a [`WriteFence`].
pub fn is_fenced(kind: Kind) -> bool {
    FENCED_KINDS.contains(&kind)
}

/// flotilla's fencing record (an addition to OCM's status): the shard, lease epoch and gateway
/// of the last fenced write of the object's status, and for a work's status the agent's report
/// sequence. The store refuses a later write under an older epoch of the same shard, or of an
/// older report, whoever makes it. Written by the store on fenced writes only; other writers
/// keep it as stored.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WriteFence {
    /// The virtual shard of the object's cluster, as the writing gateway counted the fleet's
    /// shards.
    // The apiserver knows int32 and int64, not schemars' uint32/uint64 (it warns on every
    // apply); the schema's minimum 0 keeps them unsigned.
    #[schemars(extend("format" = "int64"))]
    pub shard: u32,
    /// The epoch (the shard lease's `leaseTransitions` when the writer claimed it) the write was
    /// made under; 0 from a single-node hub, which holds every shard without leases.
    #[schemars(extend("format" = "int64"))]
    pub epoch: u32,
    /// The name of the gateway that wrote.
    pub gateway: String,
    /// The agent's sequence number of the status report written (work statuses only): a report
    /// older than the stored one never replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "int64"))]
    pub report_sequence: Option<u64>,
}

impl WriteFence {
    /// The fence of `gateway`'s write under `epoch` of `shard`, without a report sequence.
    pub fn new(shard: u32, epoch: u32, gateway: impl Into<String>) -> WriteFence {
        WriteFence {
            shard,
            epoch,
            gateway: gateway.into(),
            report_sequence: None,
        }
    }

    /// This fence, for the agent's report `sequence`.
    pub fn with_report(self, sequence: u64) -> WriteFence {
        WriteFence {
            report_sequence: Some(sequence),
            ..self
        }
    }

    /// The record stored in `status` (a JSON map), if it has one that reads as a record.
    pub fn of_status(status: &serde_json::Value) -> Option<WriteFence> {
        serde_json::from_value(status.get(FENCE_FIELD)?.clone()).ok()
    }

    /// The record stored in `object`'s status, if any.
    pub fn of_object(object: &serde_json::Value) -> Option<WriteFence> {
        WriteFence::of_status(object.get("status")?)
    }

    /// The record of `object`'s last fenced spec write ([`SPEC_FENCE_ANNOTATION`]), if it has
    /// one that reads as a record.
    pub fn of_spec_annotation(object: &serde_json::Value) -> Option<WriteFence> {
        let text = object
            .get("metadata")?
            .get("annotations")?
            .get(SPEC_FENCE_ANNOTATION)?
            .as_str()?;
        serde_json::from_str(text).ok()
    }

    /// The record a fenced write of `object` is judged against: its status's record, with the
    /// epoch (and gateway) of its last fenced spec write when that is newer on the same shard,
    /// the report sequence always the status's (only status writes carry reports).
    pub fn recorded(object: &serde_json::Value) -> Option<WriteFence> {
        let by_spec = WriteFence::of_spec_annotation(object).map(|f| WriteFence {
            report_sequence: None,
            ..f
        });
        match (WriteFence::of_object(object), by_spec) {
            (Some(status), Some(spec))
                if spec.shard == status.shard && spec.epoch > status.epoch =>
            {
                Some(WriteFence {
                    report_sequence: status.report_sequence,
                    ..spec
                })
            }
            (Some(status), _) => Some(status),
            (None, spec) => spec,
        }
    }

    /// Sets this record (without a report sequence) as `object`'s [`SPEC_FENCE_ANNOTATION`].
    pub fn set_as_spec_annotation(&self, object: &mut serde_json::Value) {
        let record = WriteFence {
            report_sequence: None,
            ..self.clone()
        };
        let (Some(meta), Ok(text)) = (
            object.get_mut("metadata").and_then(|m| m.as_object_mut()),
            serde_json::to_string(&record),
        ) else {
            return;
        };
        let annotations = meta
            .entry("annotations")
            .or_insert_with(|| serde_json::Value::Object(Default::default()));
        if !annotations.is_object() {
            *annotations = serde_json::Value::Object(Default::default());
        }
        if let Some(map) = annotations.as_object_mut() {
            map.insert(SPEC_FENCE_ANNOTATION.to_owned(), text.into());
        }
    }

    /// Sets this record as `status`'s (a JSON map; anything else is left alone).
    pub fn set_in(&self, status: &mut serde_json::Value) {
        if let (Some(map), Ok(record)) = (status.as_object_mut(), serde_json::to_value(self)) {
            map.insert(FENCE_FIELD.to_owned(), record);
        }
    }
}

impl std::fmt::Display for WriteFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "shard {} epoch {} by gateway {:?}",
            self.shard, self.epoch, self.gateway
        )?;
        if let Some(sequence) = self.report_sequence {
            write!(f, ", report {sequence}")?;
        }
        Ok(())
    }
}

/// Why a fenced write is refused. Neither is retryable: the object holds something newer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stale {
    /// The object was written under a newer epoch of the same shard: another gateway took the
    /// shard since the writer checked its fence.
    Epoch,
    /// The object holds a newer report of the agent than the one written.
    Report,
}

impl Stale {
    /// The label value and log word: `stale_epoch`, `stale_report`.
    pub fn reason(self) -> &'static str {
        match self {
            Stale::Epoch => "stale_epoch",
            Stale::Report => "stale_report",
        }
    }
}

impl std::fmt::Display for Stale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.reason())
    }
}

/// The rule: may a write under `attempted` replace an object whose stored record is `stored`?
///
/// 1. No stored record: yes (the first fenced write, or an object no gateway wrote yet).
/// 2. The same shard and an older epoch: no, [`Stale::Epoch`].
/// 3. Both carry a report sequence and the attempted one is older: no, [`Stale::Report`],
///    whoever writes and whatever the epochs (a reconnected agent's resend must not undo a
///    newer report another gateway stored).
/// 4. Otherwise yes: an equal sequence under an equal or newer epoch (a new owner rewriting the
///    same report raises the epoch), and a different shard number, which happens only when the
///    fleet's `--shards` changed: epochs of different shards' leases cannot be compared, and
///    refusing would leave the object stuck until a gateway of the old numbering wrote it.
pub fn judge(attempted: &WriteFence, stored: Option<&WriteFence>) -> Result<(), Stale> {
    let Some(stored) = stored else {
        return Ok(());
    };
    if stored.shard == attempted.shard && attempted.epoch < stored.epoch {
        return Err(Stale::Epoch);
    }
    if let (Some(attempted), Some(stored)) = (attempted.report_sequence, stored.report_sequence)
        && attempted < stored
    {
        return Err(Stale::Report);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fence(shard: u32, epoch: u32, report: Option<u64>) -> WriteFence {
        WriteFence {
            shard,
            epoch,
            gateway: format!("gw-{epoch}"),
            report_sequence: report,
        }
    }

    #[test]
    fn the_rule() {
        let check = |attempted: WriteFence, stored: Option<WriteFence>, want: Result<(), Stale>| {
            assert_eq!(
                judge(&attempted, stored.as_ref()),
                want,
                "{attempted} over {stored:?}"
            );
        };
        // Nothing stored: accepted, with or without a sequence.
        check(fence(3, 1, None), None, Ok(()));
        check(fence(3, 0, Some(1)), None, Ok(()));
        // Epochs of one shard.
        check(
            fence(3, 1, None),
            Some(fence(3, 2, None)),
            Err(Stale::Epoch),
        );
        check(fence(3, 2, None), Some(fence(3, 2, None)), Ok(()));
        check(fence(3, 3, None), Some(fence(3, 2, None)), Ok(()));
        // An older epoch is refused even with a newer report: the old owner lost the shard.
        check(
            fence(3, 1, Some(9)),
            Some(fence(3, 2, Some(5))),
            Err(Stale::Epoch),
        );
        // Reports, whoever writes.
        check(
            fence(3, 5, Some(4)),
            Some(fence(3, 2, Some(5))),
            Err(Stale::Report),
        );
        check(
            fence(3, 2, Some(4)),
            Some(fence(3, 2, Some(5))),
            Err(Stale::Report),
        );
        check(fence(3, 2, Some(5)), Some(fence(3, 2, Some(5))), Ok(()));
        check(fence(3, 3, Some(5)), Some(fence(3, 2, Some(5))), Ok(()));
        check(fence(3, 2, Some(6)), Some(fence(3, 2, Some(5))), Ok(()));
        // One side without a sequence: only epochs count.
        check(fence(3, 2, None), Some(fence(3, 2, Some(5))), Ok(()));
        check(fence(3, 2, Some(1)), Some(fence(3, 2, None)), Ok(()));
        // Another shard number (the fleet's --shards changed): epochs do not compare.
        check(fence(4, 1, None), Some(fence(3, 9, None)), Ok(()));
        check(
            fence(4, 1, Some(1)),
            Some(fence(3, 9, Some(2))),
            Err(Stale::Report),
        );
        // The single-node hub writes under epoch 0: a leased owner's first epoch is 1.
        check(
            fence(3, 0, None),
            Some(fence(3, 1, None)),
            Err(Stale::Epoch),
        );
    }

    #[test]
    fn the_record_in_a_status() {
        let mut status = json!({"conditions": []});
        assert_eq!(WriteFence::of_status(&status), None);
        let written = fence(7, 2, Some(1_700_000_000_000_000));
        written.set_in(&mut status);
        assert_eq!(
            status[FENCE_FIELD],
            json!({"shard": 7, "epoch": 2, "gateway": "gw-2", "reportSequence": 1_700_000_000_000_000u64})
        );
        assert_eq!(WriteFence::of_status(&status), Some(written.clone()));
        assert_eq!(
            WriteFence::of_object(&json!({"status": status})),
            Some(written)
        );
        let health = fence(7, 2, None);
        assert_eq!(
            serde_json::to_value(&health).unwrap(),
            json!({"shard": 7, "epoch": 2, "gateway": "gw-2"}),
            "no sequence, no field"
        );
        assert_eq!(
            health.to_string(),
            "shard 7 epoch 2 by gateway \"gw-2\"",
            "as errors and logs name it"
        );
        assert!(is_fenced(Kind::ManifestWork) && is_fenced(Kind::ManagedCluster));
        assert!(is_fenced(Kind::ClusterCompliance));
    }

    #[test]
    fn a_spec_writes_record_counts_where_it_is_newer_on_the_same_shard() {
        let mut object = json!({"metadata": {"name": "web"}});
        assert_eq!(WriteFence::recorded(&object), None);
        // Only a spec write so far: its record, never a report sequence.
        fence(3, 4, Some(9)).set_as_spec_annotation(&mut object);
        assert_eq!(
            object["metadata"]["annotations"][SPEC_FENCE_ANNOTATION],
            json!(r#"{"shard":3,"epoch":4,"gateway":"gw-4"}"#)
        );
        assert_eq!(WriteFence::recorded(&object), Some(fence(3, 4, None)));
        // A status written under an older epoch: the spec write's epoch, the status's report.
        object["status"] = json!({});
        fence(3, 2, Some(7)).set_in(&mut object["status"]);
        assert_eq!(WriteFence::recorded(&object), Some(fence(3, 4, Some(7))));
        assert_eq!(
            judge(
                &fence(3, 2, Some(8)),
                WriteFence::recorded(&object).as_ref()
            ),
            Err(Stale::Epoch),
            "the old owner's status after the new owner's spec write"
        );
        // A status as new or newer, or of another shard: the status's record.
        fence(3, 4, Some(8)).set_in(&mut object["status"]);
        assert_eq!(WriteFence::recorded(&object), Some(fence(3, 4, Some(8))));
        fence(5, 1, Some(9)).set_in(&mut object["status"]);
        assert_eq!(WriteFence::recorded(&object), Some(fence(5, 1, Some(9))));
        // An annotation that does not read as a record counts for nothing.
        object["metadata"]["annotations"][SPEC_FENCE_ANNOTATION] = json!("epoch 9");
        assert_eq!(WriteFence::recorded(&object), Some(fence(5, 1, Some(9))));
        assert!(!is_fenced(Kind::Placement));
        assert!(!is_fenced(Kind::ConfigMap), "no gateway writes a ConfigMap");
    }
}
