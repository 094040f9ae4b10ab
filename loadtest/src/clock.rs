//! Timestamps that the harness's processes can compare: nanoseconds of `CLOCK_MONOTONIC`, the
//! clock `tokio::time::Instant` reads on Linux, shared by every process on the machine.
//!
//! Durations inside one process use `tokio::time::Instant`; a stamp is only for an event that
//! another process (the coordinator) puts on the same axis as its own, e.g. an agent's ack in a
//! worker against the create of a ManifestWork in the coordinator.

use std::time::Duration;

use nix::time::{ClockId, clock_gettime};

/// Nanoseconds since an arbitrary, machine-wide origin.
pub type Stamp = u64;

/// Now, as a [`Stamp`].
pub fn now() -> Stamp {
    let ts = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC is always readable");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

/// `later - earlier`, zero if the order is reversed.
pub fn between(earlier: Stamp, later: Stamp) -> Duration {
    Duration::from_nanos(later.saturating_sub(earlier))
}

#[cfg(test)]
mod tests {
    #[test]
    fn stamps_move_forward() {
        let a = super::now();
        let b = super::now();
        assert!(b >= a);
        assert_eq!(super::between(b, a), std::time::Duration::ZERO);
    }
}
