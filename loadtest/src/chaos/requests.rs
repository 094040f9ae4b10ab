//! The apiserver requests a chaos run may cost, from the formula of `docs/capacity.md`, and
//! the requests it did cost, counted across apiserver restarts.
//!
//! The formula's terms, each from the capacity table: a ManifestWork delivered to a cluster
//! costs 4 requests (5.1 measured: a finalizer PUT retried after a conflict), taken as 6; a
//! gateway start costs one LIST and one WATCH of ManagedClusters and of ManifestWorks (4),
//! taken as 8 to allow one relist of each kind, as `loadtest/tests/sharded.rs` does; a
//! gateway whose watches broke (the apiserver restarted, or its relay was cut) lists and
//! watches again as if it had started; a cluster coming back costs 2 (its status GET and
//! PATCH) and one turning Unknown and back 2 more; the leases cost, every `--renew-period`, a
//! LIST per gateway, a PUT per held shard and a PUT of each gateway's own lease; the hub's
//! housekeeping about 30 a minute. Not in the table, and taken here as one LIST and one WATCH
//! per kind: a hub start (ten kinds, 20) and a shard moving to another gateway (its clusters
//! and works, 4); and the operator's own requests tried again after a fault made them fail,
//! each of which may have reached the apiserver (a POST, and a PUT after its conflict: 2).
//!
//! The apiserver's counters start from zero when it restarts, so the run's count is the sum
//! of the windows between restarts: each closed by a snapshot just before a stop, the next
//! opened by one just after the start.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::apiserver::ApiserverSnapshot;
use crate::report::ApiserverLoad;

pub const PER_DELIVERY: u64 = 6;
pub const PER_GATEWAY_START: u64 = 8;
pub const PER_CLUSTER_BACK: u64 = 2;
pub const PER_UNKNOWN_MARK: u64 = 2;
pub const PER_HUB_START: u64 = 20;
pub const PER_SHARD_MOVE: u64 = 4;
pub const PER_OPERATOR_RETRY: u64 = 2;
pub const HOUSEKEEPING_PER_MINUTE: f64 = 30.0;

/// What the bound is computed from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Costs {
    /// ManifestWorks delivered or changed, summed over clusters.
    pub deliveries: u64,
    /// Gateway starts after the first, plus gateways whose watches an apiserver restart or a
    /// partition from it broke.
    pub gateway_relists: u64,
    pub hub_starts: u64,
    /// Shard Leases that changed holder.
    pub shard_moves: u64,
    /// The workload's requests to the operator API tried again after a fault made them fail
    /// (the formula counts one create per work).
    pub operator_retries: u64,
    /// Agents started again (a killed worker's).
    pub clusters_back: u64,
    pub unknown_marks: u64,
    pub gateways: u64,
    pub shards: u64,
    pub renew_period: Duration,
    pub window: Duration,
}

impl Costs {
    /// The most requests the run may cost by the formula.
    pub fn bound(&self) -> u64 {
        let renewals = self.window.as_secs_f64() / self.renew_period.as_secs_f64().max(1e-3);
        let leases = ((2 * self.gateways + self.shards) as f64 * renewals.ceil()) as u64;
        let housekeeping = (HOUSEKEEPING_PER_MINUTE * self.window.as_secs_f64() / 60.0).ceil();
        self.deliveries * PER_DELIVERY
            + self.gateway_relists * PER_GATEWAY_START
            + self.hub_starts * PER_HUB_START
            + self.shard_moves * PER_SHARD_MOVE
            + self.operator_retries * PER_OPERATOR_RETRY
            + self.clusters_back * PER_CLUSTER_BACK
            + self.unknown_marks * PER_UNKNOWN_MARK
            + leases
            + housekeeping as u64
    }
}

/// Requests counted over windows between apiserver restarts.
#[derive(Default)]
pub struct Meter {
    open: Option<ApiserverSnapshot>,
    /// Requests of the closed windows.
    pub closed: u64,
    /// The same by verb and resource (`"PUT leases"`).
    pub by_verb_resource: BTreeMap<String, u64>,
    pub windows: u64,
}

impl Meter {
    /// Opens a window at `now` (at the start, and after the apiserver started again).
    pub fn open(&mut self, now: Option<ApiserverSnapshot>) {
        self.open = now;
    }

    /// Closes the window at `now` (before the apiserver stops, and at the end).
    pub fn close(&mut self, now: Option<ApiserverSnapshot>, own_watches: u64) {
        if let (Some(before), Some(now)) = (self.open.take(), now) {
            let load: ApiserverLoad = now.load_since(&before, own_watches);
            self.closed += load.requests;
            for (k, n) in load.requests_by_verb_resource {
                *self.by_verb_resource.entry(k).or_default() += n;
            }
            self.windows += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_adds_each_term_of_the_formula() {
        let quiet = Costs {
            gateways: 3,
            shards: 16,
            renew_period: Duration::from_secs(1),
            window: Duration::from_secs(60),
            ..Default::default()
        };
        // (2 × 3 + 16) × 60 renewals, and 30 housekeeping requests.
        assert_eq!(quiet.bound(), 22 * 60 + 30);
        let busy = Costs {
            deliveries: 900,
            gateway_relists: 5,
            hub_starts: 1,
            shard_moves: 7,
            operator_retries: 10,
            clusters_back: 150,
            unknown_marks: 2,
            ..quiet.clone()
        };
        assert_eq!(
            busy.bound() - quiet.bound(),
            900 * 6 + 5 * 8 + 20 + 7 * 4 + 10 * 2 + 150 * 2 + 2 * 2
        );
    }
}
