//! When an agent renews its certificate: a pure function of the certificate's validity, so
//! that the policy is the same everywhere and tested without a clock.

use std::time::{Duration, SystemTime};

/// Fraction of a certificate's lifetime after which the agent asks for a new one (OCM's
/// klusterlet renews at about 70–90%; two thirds leaves a third of the lifetime, ten days for
/// the default 30, to ride out a hub outage and still renew).
pub const RENEW_AT_FRACTION: (u32, u32) = (2, 3);

/// The moment to renew a certificate valid from `not_before` to `not_after`: two thirds of the
/// way through. A certificate whose validity is empty or inverted is due at once (at
/// `not_before`), so the agent asks for a usable one rather than waiting.
pub fn renew_at(not_before: SystemTime, not_after: SystemTime) -> SystemTime {
    let lifetime = not_after
        .duration_since(not_before)
        .unwrap_or(Duration::ZERO);
    let (num, den) = RENEW_AT_FRACTION;
    not_before + lifetime * num / den
}
