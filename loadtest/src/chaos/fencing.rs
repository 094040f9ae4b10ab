//! Judging the gateways' fenced writes against the shard Leases' history.
//!
//! Every gateway logs each fenced write it sends (target `flotilla::fenced_write`, one JSON
//! line with `--log-format json`): the object, its shard, the epoch it wrote with, when it sent
//! it and what the store answered. The harness watches the shard Leases from the start and
//! stamps every change. Judged together, each accepted write falls in one of three classes:
//!
//! * (a) sent while no newer epoch of its shard had been claimed: its gateway held the shard.
//! * (b) sent after a newer epoch was claimed (another gateway took the shard), on an object
//!   that had not yet accepted a write of a newer epoch. The store cannot refuse it: it only
//!   knows the epoch the object carries, which is not newer. Harmless by construction: the
//!   new holder's first write to the object carries the newer epoch and replaces it, and until
//!   then the object holds what the old holder last saw, as it would had the old holder written
//!   a moment earlier.
//! * (c) accepted although the object had already accepted a newer epoch: the epoch went
//!   backwards in resourceVersion order. A violation: the store's fence failed.
//!
//! The Leases' current state cannot tell any of this: only the history can, so the harness
//! keeps it. The time of a claim is the Lease's `acquireTime` when it carries one (the
//! claimer's clock, the same machine's), else when the watch saw it; a claim seen later than it
//! happened would only move a write from (b) to (a), never hide a (c), which is judged from
//! the writes alone.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The tracing target of the gateways' fenced-write events.
pub const FENCED_WRITE_TARGET: &str = "flotilla::fenced_write";

/// What the store answered a fenced write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteOutcome {
    Written,
    RefusedStaleEpoch,
    RefusedStaleReport,
    Conflict,
    NotFound,
    Failed,
}

impl WriteOutcome {
    fn parse(s: &str) -> Option<WriteOutcome> {
        Some(match s {
            "written" => WriteOutcome::Written,
            "refused_stale_epoch" => WriteOutcome::RefusedStaleEpoch,
            "refused_stale_report" => WriteOutcome::RefusedStaleReport,
            "conflict" => WriteOutcome::Conflict,
            "not_found" => WriteOutcome::NotFound,
            "failed" => WriteOutcome::Failed,
            _ => return None,
        })
    }
}

/// One fenced write as its gateway logged it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FencedWrite {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub cluster: String,
    pub shard: u32,
    pub epoch: u64,
    pub gateway: String,
    pub report_sequence: Option<u64>,
    pub sent_at_unix_ms: u64,
    pub outcome: WriteOutcome,
    /// The object's resourceVersion after the write, when written.
    pub resource_version: Option<u64>,
    /// The epoch the object carried, when refused.
    pub stored_epoch: Option<u64>,
}

impl FencedWrite {
    /// The object written: kind, namespace, name.
    fn object(&self) -> (&str, &str, &str) {
        (&self.kind, &self.namespace, &self.name)
    }

    /// `ManifestWork lt-00001/w-3 (shard 7, epoch 2, from lt-gw-1)`.
    pub fn describe(&self) -> String {
        format!(
            "{} {}/{} (shard {}, epoch {}, from {}, resourceVersion {})",
            self.kind,
            self.namespace,
            self.name,
            self.shard,
            self.epoch,
            self.gateway,
            self.resource_version
                .map_or_else(|| "-".to_string(), |v| v.to_string())
        )
    }
}

/// Reads the fenced writes out of one gateway log of JSON lines; other lines (and lines that
/// are not JSON, such as a panic message) are skipped. Returns the writes and how many
/// fenced-write lines could not be read (a field missing or of the wrong type).
pub fn parse_log(text: &str) -> (Vec<FencedWrite>, u64) {
    let mut writes = Vec::new();
    let mut unreadable = 0;
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if v.get("target").and_then(Value::as_str) != Some(FENCED_WRITE_TARGET) {
            continue;
        }
        match from_fields(v.get("fields").unwrap_or(&Value::Null)) {
            Some(w) => writes.push(w),
            None => unreadable += 1,
        }
    }
    (writes, unreadable)
}

fn from_fields(f: &Value) -> Option<FencedWrite> {
    let text = |k: &str| f.get(k).and_then(Value::as_str).map(str::to_string);
    // Numbers arrive as JSON numbers, or as strings when the event records them with `%`.
    let number = |k: &str| match f.get(k)? {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    };
    Some(FencedWrite {
        kind: text("kind")?,
        namespace: text("namespace").unwrap_or_default(),
        name: text("name")?,
        cluster: text("cluster").unwrap_or_default(),
        shard: u32::try_from(number("shard")?).ok()?,
        epoch: number("epoch")?,
        gateway: text("gateway")?,
        report_sequence: number("report_sequence"),
        sent_at_unix_ms: number("sent_at_unix_ms")?,
        outcome: WriteOutcome::parse(&text("outcome")?)?,
        resource_version: number("resource_version"),
        stored_epoch: number("stored_epoch"),
    })
}

/// A change of one shard Lease as the harness's watch saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseChange {
    pub shard: u32,
    /// `leaseTransitions`: the epoch.
    pub epoch: u64,
    pub holder: Option<String>,
    /// When the claim happened: the Lease's `acquireTime` if set, else when it was seen.
    pub claimed_at_unix_ms: u64,
}

/// Per shard, the epochs in the order they were claimed, each with its claim time.
#[derive(Clone, Debug, Default)]
pub struct LeaseHistory {
    /// Shard → (epoch → first claim time seen).
    claims: HashMap<u32, BTreeMap<u64, u64>>,
}

impl LeaseHistory {
    pub fn from_changes(changes: &[LeaseChange]) -> LeaseHistory {
        let mut h = LeaseHistory::default();
        for c in changes {
            let at = h
                .claims
                .entry(c.shard)
                .or_default()
                .entry(c.epoch)
                .or_insert(c.claimed_at_unix_ms);
            *at = (*at).min(c.claimed_at_unix_ms);
        }
        h
    }

    /// Whether an epoch of `shard` newer than `epoch` had been claimed by `at_unix_ms`.
    fn superseded(&self, shard: u32, epoch: u64, at_unix_ms: u64) -> bool {
        self.claims.get(&shard).is_some_and(|epochs| {
            epochs
                .range(epoch + 1..)
                .any(|(_, claimed)| *claimed <= at_unix_ms)
        })
    }
}

/// The fenced writes judged: counts per class, refusals, and the violations themselves.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FencingVerdict {
    /// Fenced writes read from the gateways' logs.
    pub writes: u64,
    /// Log lines of fenced writes that could not be read.
    pub unreadable: u64,
    /// (a) accepted while its gateway held the shard.
    pub accepted_by_holder: u64,
    /// (b) accepted after another gateway claimed the shard, before the object took a newer
    /// epoch: harmless (see the module doc).
    pub accepted_stale_harmless: u64,
    /// (c) accepted after the object had accepted a newer epoch: each a violation.
    pub epoch_went_backwards: Vec<BackwardsWrite>,
    /// The store's refusals by outcome (`refused_stale_epoch`, `refused_stale_report`, ...).
    pub not_written: BTreeMap<String, u64>,
}

/// A write accepted although its object already held a newer epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BackwardsWrite {
    pub write: String,
    /// The earlier accepted write of a newer epoch to the same object.
    pub after: String,
    pub sent_at_unix_ms: u64,
}

/// Classifies every write of `writes` against `leases` (see the module doc).
pub fn judge(writes: &[FencedWrite], leases: &LeaseHistory, unreadable: u64) -> FencingVerdict {
    let mut v = FencingVerdict {
        writes: writes.len() as u64,
        unreadable,
        ..Default::default()
    };
    // Accepted writes per object in resourceVersion order (etcd's revisions: one order over
    // the whole store).
    let mut by_object: BTreeMap<(&str, &str, &str), Vec<&FencedWrite>> = BTreeMap::new();
    for w in writes {
        if w.outcome == WriteOutcome::Written {
            by_object.entry(w.object()).or_default().push(w);
        } else {
            let key = serde_json::to_value(w.outcome)
                .ok()
                .and_then(|s| s.as_str().map(str::to_string))
                .unwrap_or_default();
            *v.not_written.entry(key).or_default() += 1;
        }
    }
    for accepted in by_object.values_mut() {
        accepted.sort_by_key(|w| (w.resource_version.unwrap_or(0), w.sent_at_unix_ms));
        let mut newest: Option<&FencedWrite> = None;
        for w in accepted.iter() {
            match newest {
                Some(n) if n.epoch > w.epoch => {
                    v.epoch_went_backwards.push(BackwardsWrite {
                        write: w.describe(),
                        after: n.describe(),
                        sent_at_unix_ms: w.sent_at_unix_ms,
                    });
                    continue;
                }
                _ => newest = Some(w),
            }
            if leases.superseded(w.shard, w.epoch, w.sent_at_unix_ms) {
                v.accepted_stale_harmless += 1;
            } else {
                v.accepted_by_holder += 1;
            }
        }
    }
    v.epoch_went_backwards.sort_by_key(|b| b.sent_at_unix_ms);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, epoch: u64, gateway: &str, at: u64, rv: Option<u64>) -> FencedWrite {
        FencedWrite {
            kind: "ManifestWork".into(),
            namespace: "lt-00001".into(),
            name: name.into(),
            cluster: "lt-00001".into(),
            shard: 7,
            epoch,
            gateway: gateway.into(),
            report_sequence: Some(1),
            sent_at_unix_ms: at,
            outcome: if rv.is_some() {
                WriteOutcome::Written
            } else {
                WriteOutcome::RefusedStaleEpoch
            },
            resource_version: rv,
            stored_epoch: None,
        }
    }

    fn claim(epoch: u64, holder: &str, at: u64) -> LeaseChange {
        LeaseChange {
            shard: 7,
            epoch,
            holder: Some(holder.into()),
            claimed_at_unix_ms: at,
        }
    }

    #[test]
    fn reads_the_fenced_writes_of_a_json_log_and_nothing_else() {
        let log = r#"{"timestamp":"2026-01-01T00:00:00Z","level":"INFO","fields":{"message":"listening"},"target":"flotilla_gateway"}
not json: a panic message
{"level":"DEBUG","fields":{"message":"fenced write","kind":"ManifestWork","namespace":"lt-00003","name":"w-1","cluster":"lt-00003","shard":5,"epoch":2,"gateway":"lt-gw-1","report_sequence":4,"sent_at_unix_ms":1700000000123,"outcome":"written","resource_version":"981"},"target":"flotilla::fenced_write"}
{"level":"DEBUG","fields":{"kind":"ManagedCluster","name":"lt-00004","cluster":"lt-00004","shard":"6","epoch":1,"gateway":"lt-gw-0","sent_at_unix_ms":1700000000200,"outcome":"refused_stale_epoch","stored_epoch":2},"target":"flotilla::fenced_write"}
{"level":"DEBUG","fields":{"kind":"ManifestWork","name":"w-2","outcome":"written"},"target":"flotilla::fenced_write"}"#;
        let (writes, unreadable) = parse_log(log);
        assert_eq!(unreadable, 1, "the last line lacks shard, epoch and more");
        assert_eq!(writes.len(), 2);
        assert_eq!(writes[0].resource_version, Some(981));
        assert_eq!(writes[0].report_sequence, Some(4));
        assert_eq!(writes[1].shard, 6);
        assert_eq!(writes[1].namespace, "");
        assert_eq!(writes[1].outcome, WriteOutcome::RefusedStaleEpoch);
        assert_eq!(writes[1].stored_epoch, Some(2));
    }

    #[test]
    fn writes_are_classed_by_the_lease_history_at_their_send_time() {
        // gw-0 holds epoch 1 from t=0; gw-1 claims epoch 2 at t=100.
        let leases = LeaseHistory::from_changes(&[
            claim(1, "gw-0", 0),
            claim(1, "gw-0", 50), // a renewal seen again: the first sighting counts
            claim(2, "gw-1", 100),
        ]);
        let writes = [
            // (a): before the takeover.
            write("w-1", 1, "gw-0", 90, Some(10)),
            // (b): gw-0, paused through the takeover, writes after it; gw-1 has not written
            // w-1 yet, so the store takes it.
            write("w-1", 1, "gw-0", 120, Some(12)),
            // (a): the new holder.
            write("w-1", 2, "gw-1", 130, Some(14)),
            // Refused: the store had epoch 2 already.
            write("w-1", 1, "gw-0", 140, None),
        ];
        let v = judge(&writes, &leases, 0);
        assert_eq!(v.writes, 4);
        assert_eq!(v.accepted_by_holder, 2);
        assert_eq!(v.accepted_stale_harmless, 1);
        assert!(v.epoch_went_backwards.is_empty(), "{v:?}");
        assert_eq!(v.not_written.get("refused_stale_epoch"), Some(&1));
    }

    #[test]
    fn an_epoch_going_backwards_on_one_object_is_a_violation_whatever_the_leases_say() {
        let leases = LeaseHistory::from_changes(&[claim(1, "gw-0", 0), claim(2, "gw-1", 100)]);
        let writes = [
            write("w-1", 2, "gw-1", 130, Some(14)),
            // Accepted after epoch 2 was: the fence failed.
            write("w-1", 1, "gw-0", 140, Some(15)),
            // Another object's epoch 1 after the takeover is (b), not a violation.
            write("w-2", 1, "gw-0", 141, Some(16)),
        ];
        let v = judge(&writes, &leases, 0);
        assert_eq!(v.epoch_went_backwards.len(), 1, "{v:?}");
        let b = &v.epoch_went_backwards[0];
        assert!(
            b.write.contains("w-1") && b.write.contains("epoch 1"),
            "{b:?}"
        );
        assert!(b.after.contains("epoch 2"), "{b:?}");
        assert_eq!(v.accepted_by_holder, 1);
        assert_eq!(v.accepted_stale_harmless, 1);
    }

    #[test]
    fn a_claim_the_watch_missed_still_supersedes_older_epochs() {
        // The watch saw epochs 1 and 3 (an apiserver restart hid epoch 2).
        let leases = LeaseHistory::from_changes(&[claim(1, "gw-0", 0), claim(3, "gw-2", 300)]);
        assert!(!leases.superseded(7, 1, 299));
        assert!(leases.superseded(7, 1, 300));
        assert!(leases.superseded(7, 2, 301));
        assert!(!leases.superseded(7, 3, 10_000));
        assert!(!leases.superseded(8, 1, 10_000), "another shard");
    }
}
