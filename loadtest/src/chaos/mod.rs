//! The `chaos` scenario: faults injected at random, from a seed, into a fleet at work (gateways,
//! hub, groups of agents, partitions, the apiserver), then invariants checked from the evidence
//! the run kept.
//!
//! * [`schedule`]: the faults, drawn from `--chaos-seed`, each bounded.
//! * [`partition`]: partitions as nftables rules on loopback, and the gateways' relays to the
//!   apiserver that give each gateway's apiserver traffic a port of its own.
//! * [`fencing`]: the gateways' fenced writes judged against the shard Leases' history;
//!   [`unknown`]: the clusters marked Unknown against their agents' sessions.
//! * [`requests`]: the apiserver requests a run may cost (`docs/capacity.md`'s formula) and
//!   did cost, across apiserver restarts.
//! * [`scenario`]: the run itself.
pub mod fencing;
pub mod partition;
pub mod requests;
pub mod scenario;
pub mod schedule;
pub mod unknown;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::chaos::fencing::FencingVerdict;
use crate::chaos::schedule::Fault;

/// What the chaos scenario did and found.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ChaosReport {
    /// The seed the schedule was drawn from: `--chaos-seed` replays it.
    pub seed: u64,
    pub window_s: f64,
    /// The schedule, as drawn.
    pub faults: Vec<Fault>,
    /// Faults done, by kind.
    pub faults_by_kind: BTreeMap<String, u64>,
    /// Every act as done: when (seconds into the faults), and its error if it failed.
    pub acts: Vec<ActDone>,
    /// Shard Lease changes the watch saw, and ManagedCluster Available transitions.
    pub lease_changes: u64,
    /// The fenced writes, judged.
    pub fencing: Option<FencingVerdict>,
    /// The apiserver requests the run cost, over how many windows between restarts, and the
    /// formula's bound with what it was computed from.
    pub apiserver_requests: Option<u64>,
    pub apiserver_windows: u64,
    pub apiserver_requests_by_verb_resource: BTreeMap<String, u64>,
    pub apiserver_bound: Option<u64>,
    pub apiserver_costs: Option<requests::Costs>,
    pub invariants: Vec<Invariant>,
    /// The processes asked to stop at the end, and how each did.
    pub exits: Vec<String>,
}

/// One act of the injector as it happened.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ActDone {
    pub fault: usize,
    pub act: schedule::Act,
    pub target: usize,
    /// When it was due and when it was done, seconds after the faults began.
    pub due_s: f64,
    pub done_s: f64,
    pub error: Option<String>,
}

/// One invariant judged.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Invariant {
    pub name: String,
    pub verdict: Verdict,
    /// What it was judged from, in numbers.
    pub evidence: String,
    /// When violated: the last fault that began before the first violation.
    pub after_fault: Option<String>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Held,
    Violated,
    /// The evidence to judge it is missing (said why in the evidence).
    NotJudged,
}

impl Invariant {
    pub fn new(name: &str, held: bool, evidence: String) -> Invariant {
        Invariant {
            name: name.to_string(),
            verdict: if held {
                Verdict::Held
            } else {
                Verdict::Violated
            },
            evidence,
            after_fault: None,
        }
    }

    pub fn not_judged(name: &str, why: String) -> Invariant {
        Invariant {
            name: name.to_string(),
            verdict: Verdict::NotJudged,
            evidence: why,
            after_fault: None,
        }
    }
}

/// The fault that began last at or before `at` (seconds after the faults began).
pub fn fault_before(faults: &[Fault], at_s: f64) -> Option<&Fault> {
    faults.iter().rev().find(|f| f.at.as_secs_f64() <= at_s)
}

/// The chaos scenario's rows of the run's table.
pub fn table_rows(c: &ChaosReport, row: &mut impl FnMut(&str, String)) {
    row(
        "seed (--chaos-seed)",
        format!("{} over {:.0} s", c.seed, c.window_s),
    );
    row(
        "faults injected",
        c.faults_by_kind
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    let failed = c.acts.iter().filter(|a| a.error.is_some()).count();
    if failed > 0 {
        row("acts that failed", failed.to_string());
    }
    if let Some(f) = &c.fencing {
        row(
            "fenced writes (a / b / c)",
            format!(
                "{} / {} / {} of {}",
                f.accepted_by_holder,
                f.accepted_stale_harmless,
                f.epoch_went_backwards.len(),
                f.writes
            ),
        );
        row(
            "refused by the store",
            f.not_written
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
    }
    for i in &c.invariants {
        let verdict = match i.verdict {
            Verdict::Held => "held",
            Verdict::Violated => "VIOLATED",
            Verdict::NotJudged => "not judged",
        };
        let after = i
            .after_fault
            .as_deref()
            .map_or(String::new(), |f| format!(" after {f}"));
        row(&i.name, format!("{verdict}{after}: {}", i.evidence));
    }
}
