//! The chaos scenario's fault schedule: a list of faults, each with its time, kind, target and
//! how long it lasts, drawn from one seed. The same seed, window, kinds and targets give the
//! same schedule, so a run that found a violation can be replayed fault for fault.
//!
//! Every fault is bounded: it is undone after its duration (a killed process is started again,
//! a stopped one continued, a partition healed, the apiserver started again), and the last one
//! is undone before the window ends, so what is judged at the end is a fleet with nothing
//! broken any more. Faults follow one another with a gap and never overlap: when an invariant
//! breaks, the fault before it is the only one that can have done it.
//!
//! The random numbers come from `StdRng` seeded with the seed; its algorithm may change with a
//! major version of `rand`, so a seed replays the same schedule with the same build.

use std::time::Duration;

use clap::ValueEnum;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// The faults the chaos scenario can inject (`--chaos-faults`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ValueEnum, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL one gateway; started again on the same address after the fault's duration.
    GatewayKill,
    /// SIGSTOP one gateway, SIGCONT after the fault's duration: a pause longer than the lease
    /// duration lets another gateway take its shards while it still believes it holds them.
    GatewayStop,
    /// SIGKILL the hub; started again after the fault's duration.
    HubKill,
    /// SIGSTOP the hub, SIGCONT after the fault's duration.
    HubStop,
    /// SIGKILL one worker process of agents (a group of agents); started again after the
    /// fault's duration with the same identities and caches.
    AgentsKill,
    /// SIGSTOP one worker process of agents, SIGCONT after the fault's duration.
    AgentsStop,
    /// Drop the traffic between one gateway and the hub apiserver, healed after the fault's
    /// duration.
    GatewayApiserverPartition,
    /// Drop the traffic between the agents and one gateway (both carriers), healed after the
    /// fault's duration.
    AgentsGatewayPartition,
    /// Stop the hub's kube-apiserver and start it again on the same port and etcd after the
    /// fault's duration.
    ApiserverRestart,
}

impl FaultKind {
    /// Every kind, the default of `--chaos-faults`.
    pub const ALL: [FaultKind; 9] = [
        FaultKind::GatewayKill,
        FaultKind::GatewayStop,
        FaultKind::HubKill,
        FaultKind::HubStop,
        FaultKind::AgentsKill,
        FaultKind::AgentsStop,
        FaultKind::GatewayApiserverPartition,
        FaultKind::AgentsGatewayPartition,
        FaultKind::ApiserverRestart,
    ];

    /// The kebab-case name, as the flag and the report spell it.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::GatewayKill => "gateway-kill",
            FaultKind::GatewayStop => "gateway-stop",
            FaultKind::HubKill => "hub-kill",
            FaultKind::HubStop => "hub-stop",
            FaultKind::AgentsKill => "agents-kill",
            FaultKind::AgentsStop => "agents-stop",
            FaultKind::GatewayApiserverPartition => "gateway-apiserver-partition",
            FaultKind::AgentsGatewayPartition => "agents-gateway-partition",
            FaultKind::ApiserverRestart => "apiserver-restart",
        }
    }

    /// What a target of this kind is numbered among.
    fn target_space(self, targets: &Targets) -> usize {
        match self {
            FaultKind::GatewayKill
            | FaultKind::GatewayStop
            | FaultKind::GatewayApiserverPartition
            | FaultKind::AgentsGatewayPartition => targets.gateways,
            FaultKind::AgentsKill | FaultKind::AgentsStop => targets.workers,
            FaultKind::HubKill | FaultKind::HubStop | FaultKind::ApiserverRestart => 1,
        }
    }

    /// The shortest and longest duration of a fault of this kind, given the gateways' lease
    /// duration: pauses and partitions range from half a lease (the holder keeps its shards)
    /// to two (another gateway takes them over while the holder still runs), kills from a
    /// quick restart to a lease, and the apiserver stays down a few seconds.
    fn duration_range(self, lease: Duration) -> (Duration, Duration) {
        let half = lease / 2;
        match self {
            FaultKind::GatewayStop
            | FaultKind::GatewayApiserverPartition
            | FaultKind::AgentsGatewayPartition => (half, lease * 2),
            FaultKind::GatewayKill | FaultKind::AgentsKill | FaultKind::AgentsStop => {
                (Duration::from_millis(500), lease)
            }
            FaultKind::HubKill | FaultKind::HubStop => (Duration::from_millis(500), half),
            FaultKind::ApiserverRestart => (Duration::from_secs(1), Duration::from_secs(5)),
        }
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How many of each target there are to choose from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Targets {
    /// Gateway processes (`--gateways`).
    pub gateways: usize,
    /// Worker processes of agents (`--processes`).
    pub workers: usize,
}

/// What a schedule is drawn from.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduleSpec {
    pub seed: u64,
    /// Every fault starts and is undone within this window from the start of the faults.
    pub window: Duration,
    pub kinds: Vec<FaultKind>,
    pub targets: Targets,
    /// The gateways' `--lease-duration`, which the faults' durations are scaled to.
    pub lease_duration: Duration,
}

/// The shortest and longest quiet time between the end of one fault and the next.
const GAP: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(8));

/// One fault: `kind` done to `target` at `at` after the faults start, undone `duration` later.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    /// Its number in the schedule, from 0.
    pub index: usize,
    #[serde(with = "millis")]
    pub at: Duration,
    pub kind: FaultKind,
    /// The gateway or worker number; 0 for the hub and the apiserver.
    pub target: usize,
    #[serde(with = "millis")]
    pub duration: Duration,
}

impl Fault {
    /// When it is undone.
    pub fn end(&self) -> Duration {
        self.at + self.duration
    }

    /// `gateway-stop of gateway 1 at 12.3 s for 20.0 s`, as violations name it.
    pub fn describe(&self) -> String {
        let target = match self.kind {
            FaultKind::HubKill | FaultKind::HubStop | FaultKind::ApiserverRestart => String::new(),
            FaultKind::AgentsKill | FaultKind::AgentsStop => format!(" of worker {}", self.target),
            _ => format!(" of gateway {}", self.target),
        };
        format!(
            "fault #{} {}{target} at {:.1} s for {:.1} s",
            self.index,
            self.kind,
            self.at.as_secs_f64(),
            self.duration.as_secs_f64()
        )
    }

    /// The two actions of this fault: what is done at `at` and what undoes it at `end()`.
    pub fn actions(&self) -> [Action; 2] {
        use Act::*;
        let (inject, heal) = match self.kind {
            FaultKind::GatewayKill => (KillGateway, StartGateway),
            FaultKind::GatewayStop => (StopGateway, ContinueGateway),
            FaultKind::HubKill => (KillHub, StartHub),
            FaultKind::HubStop => (StopHub, ContinueHub),
            FaultKind::AgentsKill => (KillWorker, StartWorker),
            FaultKind::AgentsStop => (StopWorker, ContinueWorker),
            FaultKind::GatewayApiserverPartition => {
                (PartitionGatewayApiserver, HealGatewayApiserver)
            }
            FaultKind::AgentsGatewayPartition => (PartitionAgentsGateway, HealAgentsGateway),
            FaultKind::ApiserverRestart => (StopApiserver, StartApiserver),
        };
        [
            Action {
                at: self.at,
                act: inject,
                target: self.target,
                fault: self.index,
            },
            Action {
                at: self.end(),
                act: heal,
                target: self.target,
                fault: self.index,
            },
        ]
    }
}

/// One thing the injector does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Act {
    KillGateway,
    StartGateway,
    StopGateway,
    ContinueGateway,
    KillHub,
    StartHub,
    StopHub,
    ContinueHub,
    KillWorker,
    StartWorker,
    StopWorker,
    ContinueWorker,
    PartitionGatewayApiserver,
    HealGatewayApiserver,
    PartitionAgentsGateway,
    HealAgentsGateway,
    StopApiserver,
    StartApiserver,
}

impl Act {
    /// The act that undoes this one, if it breaks something.
    pub fn undone_by(self) -> Option<Act> {
        use Act::*;
        Some(match self {
            KillGateway => StartGateway,
            StopGateway => ContinueGateway,
            KillHub => StartHub,
            StopHub => ContinueHub,
            KillWorker => StartWorker,
            StopWorker => ContinueWorker,
            PartitionGatewayApiserver => HealGatewayApiserver,
            PartitionAgentsGateway => HealAgentsGateway,
            StopApiserver => StartApiserver,
            _ => return None,
        })
    }
}

/// An act at a time after the faults start, on a target, for fault number `fault`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Action {
    #[serde(with = "millis")]
    pub at: Duration,
    pub act: Act,
    pub target: usize,
    pub fault: usize,
}

/// The faults of `spec`, in time order, none overlapping another, all undone within the
/// window. Kinds without a target (no workers for `agents-*`) are left out.
pub fn schedule(spec: &ScheduleSpec) -> Vec<Fault> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed);
    let mut kinds: Vec<FaultKind> = spec
        .kinds
        .iter()
        .copied()
        .filter(|k| k.target_space(&spec.targets) > 0)
        .collect();
    // The flag's order must not change the schedule.
    kinds.sort();
    kinds.dedup();
    let mut faults = Vec::new();
    if kinds.is_empty() {
        return faults;
    }
    let mut now = between(&mut rng, GAP);
    loop {
        let kind = kinds[rng.random_range(0..kinds.len())];
        let target = rng.random_range(0..kind.target_space(&spec.targets));
        let duration = between(&mut rng, kind.duration_range(spec.lease_duration));
        if now + duration > spec.window {
            return faults;
        }
        faults.push(Fault {
            index: faults.len(),
            at: now,
            kind,
            target,
            duration,
        });
        now += duration + between(&mut rng, GAP);
    }
}

/// Every action of `faults`, in time order (a heal before an inject at the same instant).
pub fn actions(faults: &[Fault]) -> Vec<Action> {
    let mut all: Vec<Action> = faults.iter().flat_map(Fault::actions).collect();
    all.sort_by_key(|a| (a.at, a.act.undone_by().is_some(), a.fault));
    all
}

/// A duration between `lo` and `hi`, to the millisecond.
fn between(rng: &mut impl Rng, (lo, hi): (Duration, Duration)) -> Duration {
    let (lo, hi) = (lo.as_millis() as u64, hi.as_millis() as u64);
    Duration::from_millis(rng.random_range(lo..=hi.max(lo)))
}

/// Durations in the report as milliseconds.
mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn spec(seed: u64) -> ScheduleSpec {
        ScheduleSpec {
            seed,
            window: Duration::from_secs(600),
            kinds: FaultKind::ALL.to_vec(),
            targets: Targets {
                gateways: 3,
                workers: 4,
            },
            lease_duration: Duration::from_secs(15),
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule_and_another_seed_another() {
        let a = schedule(&spec(7));
        assert!(a.len() > 10, "a ten-minute window holds many faults: {a:?}");
        assert_eq!(a, schedule(&spec(7)));
        let mut reordered = spec(7);
        reordered.kinds.reverse();
        assert_eq!(a, schedule(&reordered), "the flag's order does not matter");
        assert_ne!(a, schedule(&spec(8)));
    }

    #[test]
    fn every_fault_is_undone_within_the_window_before_the_next_begins() {
        for seed in 0..50 {
            let s = spec(seed);
            let faults = schedule(&s);
            for pair in faults.windows(2) {
                assert!(pair[0].end() < pair[1].at, "seed {seed}: {pair:?} overlap");
            }
            // Every inject is followed by its own undo, on the same target, before anything
            // else happens, and nothing is left broken at the end.
            let acts = actions(&faults);
            assert_eq!(acts.len(), faults.len() * 2);
            for pair in acts.chunks(2) {
                let (inject, heal) = (pair[0], pair[1]);
                assert_eq!(
                    inject.act.undone_by(),
                    Some(heal.act),
                    "seed {seed}: {pair:?}"
                );
                assert_eq!((inject.target, inject.fault), (heal.target, heal.fault));
                assert!(
                    inject.at < heal.at && heal.at <= s.window,
                    "seed {seed}: {pair:?}"
                );
            }
            for f in &faults {
                let (lo, hi) = f.kind.duration_range(s.lease_duration);
                assert!((lo..=hi).contains(&f.duration), "seed {seed}: {f:?}");
                assert!(
                    f.target < f.kind.target_space(&s.targets),
                    "seed {seed}: {f:?}"
                );
            }
        }
    }

    #[test]
    fn only_the_kinds_asked_for_and_with_a_target_are_drawn() {
        let mut s = spec(3);
        s.kinds = vec![FaultKind::GatewayStop, FaultKind::AgentsKill];
        s.targets.workers = 0;
        let faults = schedule(&s);
        assert!(!faults.is_empty());
        assert!(faults.iter().all(|f| f.kind == FaultKind::GatewayStop));
        s.kinds = vec![FaultKind::AgentsStop];
        assert!(schedule(&s).is_empty());
    }

    #[test]
    fn a_long_window_draws_every_kind_and_every_target() {
        let faults = schedule(&ScheduleSpec {
            window: Duration::from_secs(3600),
            ..spec(11)
        });
        let mut seen: BTreeMap<FaultKind, Vec<usize>> = BTreeMap::new();
        for f in &faults {
            seen.entry(f.kind).or_default().push(f.target);
        }
        assert_eq!(seen.len(), FaultKind::ALL.len(), "{seen:?}");
        for target in 0..3 {
            assert!(seen[&FaultKind::GatewayStop].contains(&target), "{seen:?}");
        }
    }

    #[test]
    fn a_fault_names_its_kind_target_and_time() {
        let f = Fault {
            index: 4,
            at: Duration::from_millis(12_300),
            kind: FaultKind::GatewayStop,
            target: 1,
            duration: Duration::from_secs(20),
        };
        assert_eq!(
            f.describe(),
            "fault #4 gateway-stop of gateway 1 at 12.3 s for 20.0 s"
        );
    }
}
