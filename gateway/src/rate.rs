//! Herd control at the door: a token bucket for new sessions ([`SessionRate`], a GCRA), asked
//! by both carriers about every new connection before its TLS handshake ([`SessionGate`]).
//!
//! What it counts: connection attempts on the agents' listener, before TLS — every accepted
//! TCP connection and every QUIC `Incoming`, whatever it turns out to carry (a session, a
//! join, a relay hop, a handshake that fails). Counting before the handshake is what makes the
//! bound hold whatever the handshake costs: at a rate of R per second with a burst of B, at
//! most `R·t + B` connections are let through to a session in any `t` seconds.
//!
//! What an attempt over the rate gets: not a drop, which would send its agent into a blind
//! backoff and bring the herd back as a herd, but a retry-after, told before any TLS work
//! (`flotilla_transport::gate` says how on each carrier). The retry-afters are the bucket's own future
//! slots, one interval apart, so the refused agents come back at the rate rather than
//! together, and find tokens when they do.

use std::sync::Arc;
use std::time::Duration;

use flotilla_transport::Carrier;
use flotilla_transport::gate::{ConnectionGate, Entry};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;
use tokio::time::Instant;

/// Default of `--session-rate` (`GatewayConfig::session_rate`): new sessions per second one
/// process lets in.
pub const DEFAULT_SESSION_RATE: u32 = 1000;
/// Default of `--session-burst` (`GatewayConfig::session_burst`).
pub const DEFAULT_SESSION_BURST: u32 = 1000;
/// The longest retry-after the bucket gives. A herd larger than the rate can serve within it
/// is told this for the rest (their agents' own jitter spreads them), so that a mistaken
/// tiny rate cannot park agents for hours.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// Held for a few arithmetic operations, never across an await: a plain mutex cannot block
/// the runtime here, and the accept loops call it once per connection.
#[allow(clippy::disallowed_types)]
type SyncMutex<T> = std::sync::Mutex<T>;

/// A token bucket of `rate` new sessions per second with room for `burst` at once, in its
/// GCRA form: one theoretical arrival time instead of a token count and a refill timer.
/// Time is passed in, so tests drive it with any clock.
#[derive(Debug)]
pub struct SessionRate {
    /// One token's worth of time: 1/rate.
    interval: Duration,
    /// How far the theoretical arrival time may run ahead of now and still admit:
    /// (burst − 1) intervals, so that a full bucket admits `burst` at once.
    tolerance: Duration,
    state: SyncMutex<RateState>,
}

#[derive(Debug, Default)]
struct RateState {
    /// When the bucket would next be empty-handed if admissions went on at the rate: each
    /// admission moves it one interval later. `None` until the first attempt (a full bucket).
    tat: Option<Instant>,
    /// The next slot to give a refused attempt as its time to come back; each refusal takes
    /// one and moves it one interval later, so the refused come back spread at the rate.
    next_slot: Option<Instant>,
}

impl SessionRate {
    /// A full bucket of `burst` (at least 1) refilled at `per_second` (at least 1).
    pub fn new(per_second: u32, burst: u32) -> SessionRate {
        let interval = Duration::from_secs(1) / per_second.max(1);
        SessionRate {
            interval,
            tolerance: interval * (burst.max(1) - 1),
            state: SyncMutex::default(),
        }
    }

    /// An attempt at `now`: admitted (taking a token), or over the rate with the time to come
    /// back after (its own future slot, at most [`MAX_RETRY_AFTER`]).
    pub fn attempt(&self, now: Instant) -> Entry {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let tat = state.tat.map_or(now, |t| t.max(now));
        if tat <= now + self.tolerance {
            state.tat = Some(tat + self.interval);
            return Entry::Admitted;
        }
        // The bucket has a token again at `tat - tolerance`; the refused queue up from there.
        let free_at = tat - self.tolerance;
        let slot = state.next_slot.map_or(free_at, |s| s.max(free_at));
        let wait = slot - now;
        if wait > MAX_RETRY_AFTER {
            return Entry::OverRate {
                retry_after: MAX_RETRY_AFTER,
            };
        }
        state.next_slot = Some(slot + self.interval);
        Entry::OverRate { retry_after: wait }
    }
}

/// The gate both carriers ask: whether the gateway serves at all yet
/// ([`crate::shards::cache::serving`]), then the bucket; and the count of what it said
/// (`flotilla_gateway_new_connections_total`). It also tells the carriers when to stop
/// accepting ([`crate::shards::cache::accepting`]).
#[derive(Debug)]
pub struct SessionGate {
    rate: SessionRate,
    /// False while the gateway cannot serve any session: connections are closed before TLS
    /// and take no token.
    serving: watch::Receiver<bool>,
    /// False while the gateway loads the shards it holds and serves in a moment: the carriers
    /// leave new connections unaccepted.
    accepting: watch::Receiver<bool>,
    /// By outcome (admitted, over_rate, not_ready) and carrier (grpc, quic), resolved once.
    counted: [[Counter; 2]; 3],
}

impl SessionGate {
    pub(crate) fn new(
        rate: SessionRate,
        serving: watch::Receiver<bool>,
        accepting: watch::Receiver<bool>,
        counted: [[Counter; 2]; 3],
    ) -> Arc<SessionGate> {
        Arc::new(SessionGate {
            rate,
            serving,
            accepting,
            counted,
        })
    }
}

impl ConnectionGate for SessionGate {
    fn arrived(&self, carrier: Carrier) -> Entry {
        let entry = if *self.serving.borrow() {
            self.rate.attempt(Instant::now())
        } else {
            Entry::NotReady
        };
        let outcome = match entry {
            Entry::Admitted => 0,
            Entry::OverRate { .. } => 1,
            Entry::NotReady => 2,
        };
        let transport = match carrier {
            Carrier::Grpc => 0,
            Carrier::Quic => 1,
        };
        self.counted[outcome][transport].inc();
        entry
    }

    fn accepting(&self) -> Option<watch::Receiver<bool>> {
        Some(self.accepting.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn admitted(entry: Entry) -> bool {
        entry == Entry::Admitted
    }

    fn retry_after(entry: Entry) -> Duration {
        match entry {
            Entry::OverRate { retry_after } => retry_after,
            other => panic!("{other:?}, expected over the rate"),
        }
    }

    /// A full bucket lets the burst through at once, then one per interval.
    #[test]
    fn the_burst_then_the_rate() {
        let rate = SessionRate::new(10, 5);
        let t0 = Instant::now();
        let at_once: Vec<bool> = (0..8).map(|_| admitted(rate.attempt(t0))).collect();
        assert_eq!(at_once, [true, true, true, true, true, false, false, false]);
        // One token comes back every 100 ms.
        assert!(!admitted(rate.attempt(t0 + 50 * MS)));
        assert!(admitted(rate.attempt(t0 + 100 * MS)));
        assert!(!admitted(rate.attempt(t0 + 150 * MS)));
        assert!(admitted(rate.attempt(t0 + 200 * MS)));
        // An idle second refills the bucket to its burst, never beyond.
        let later = t0 + Duration::from_secs(10);
        let refilled = (0..8).filter(|_| admitted(rate.attempt(later))).count();
        assert_eq!(refilled, 5);
    }

    /// Whatever the arrivals, no window from the start admits more than rate·t + burst.
    #[test]
    fn admissions_never_exceed_rate_times_elapsed_plus_burst() {
        let (per_second, burst) = (20u32, 5u32);
        let rate = SessionRate::new(per_second, burst);
        let t0 = Instant::now();
        let mut admitted_so_far = 0u64;
        // 3000 attempts over 3 s in clumps of 50 at once, with a quiet half second.
        for i in 0..3000u32 {
            let clump = i - i % 50;
            let quiet = if clump >= 1500 { 500 } else { 0 };
            let at = t0 + MS * (clump + quiet);
            if admitted(rate.attempt(at)) {
                admitted_so_far += 1;
            }
            let elapsed = at - t0;
            let bound =
                (elapsed.as_secs_f64() * f64::from(per_second)).floor() as u64 + u64::from(burst);
            assert!(
                admitted_so_far <= bound,
                "{admitted_so_far} admitted by {elapsed:?}, bound {bound}"
            );
        }
        // And the rate is used, not just bounded: one per interval while attempts keep coming,
        // and the burst again after the quiet half second (5 + 29, twice).
        assert_eq!(admitted_so_far, 68);
    }

    /// The refused are told to come back one interval apart, from when a token is free: they
    /// return at the rate, and each finds a token.
    #[test]
    fn the_refused_come_back_spread_at_the_rate_and_get_in() {
        let rate = SessionRate::new(10, 2);
        let t0 = Instant::now();
        assert!(admitted(rate.attempt(t0)));
        assert!(admitted(rate.attempt(t0)));
        let waits: Vec<Duration> = (0..5).map(|_| retry_after(rate.attempt(t0))).collect();
        assert_eq!(
            waits,
            [100 * MS, 200 * MS, 300 * MS, 400 * MS, 500 * MS],
            "one interval apart, from the first free token"
        );
        for wait in waits {
            assert!(
                admitted(rate.attempt(t0 + wait)),
                "coming back after {wait:?}"
            );
        }
        // A latecomer queues behind the slots already given.
        assert_eq!(retry_after(rate.attempt(t0 + 500 * MS)), 100 * MS);
    }

    /// Slots given long ago do not push new refusals back: a queue in the past is empty.
    #[test]
    fn old_slots_do_not_delay_a_later_refusal() {
        let rate = SessionRate::new(10, 1);
        let t0 = Instant::now();
        assert!(admitted(rate.attempt(t0)));
        for _ in 0..3 {
            retry_after(rate.attempt(t0));
        }
        let later = t0 + Duration::from_secs(60);
        assert!(admitted(rate.attempt(later)));
        assert_eq!(retry_after(rate.attempt(later)), 100 * MS);
    }

    /// A herd larger than the rate can serve within the longest retry-after is told that
    /// longest delay, never more.
    #[test]
    fn retry_afters_are_bounded() {
        let rate = SessionRate::new(1, 1);
        let t0 = Instant::now();
        assert!(admitted(rate.attempt(t0)));
        let waits: Vec<Duration> = (0..400).map(|_| retry_after(rate.attempt(t0))).collect();
        assert_eq!(waits[0], Duration::from_secs(1));
        assert_eq!(waits[299], MAX_RETRY_AFTER);
        assert!(waits.iter().all(|w| *w <= MAX_RETRY_AFTER));
        assert_eq!(waits[399], MAX_RETRY_AFTER);
    }

    /// The gate counts each attempt once, by outcome and carrier.
    #[test]
    fn the_gate_counts_by_outcome_and_carrier() {
        let counted: [[Counter; 2]; 3] = Default::default();
        let (_serving, serving_rx) = watch::channel(true);
        let (_accepting, accepting_rx) = watch::channel(true);
        let gate = SessionGate::new(
            SessionRate::new(1, 2),
            serving_rx,
            accepting_rx,
            counted.clone(),
        );
        assert_eq!(gate.arrived(Carrier::Grpc), Entry::Admitted);
        assert_eq!(gate.arrived(Carrier::Quic), Entry::Admitted);
        assert!(matches!(
            gate.arrived(Carrier::Quic),
            Entry::OverRate { .. }
        ));
        let got = counted.map(|by| by.map(|c| c.get()));
        assert_eq!(got, [[1, 1], [0, 1], [0, 0]]);
    }

    /// A gateway not serving yet closes connections before TLS and spends no token on them:
    /// once it serves, the bucket is as full as it was.
    #[test]
    fn a_gateway_not_serving_closes_connections_without_taking_tokens() {
        let counted: [[Counter; 2]; 3] = Default::default();
        let (serving, serving_rx) = watch::channel(false);
        let (_accepting, accepting_rx) = watch::channel(true);
        let gate = SessionGate::new(
            SessionRate::new(1, 2),
            serving_rx,
            accepting_rx,
            counted.clone(),
        );
        for _ in 0..5 {
            assert_eq!(gate.arrived(Carrier::Grpc), Entry::NotReady);
        }
        assert_eq!(gate.arrived(Carrier::Quic), Entry::NotReady);
        serving.send_replace(true);
        assert_eq!(gate.arrived(Carrier::Grpc), Entry::Admitted);
        assert_eq!(gate.arrived(Carrier::Grpc), Entry::Admitted);
        let got = counted.map(|by| by.map(|c| c.get()));
        assert_eq!(got, [[2, 0], [0, 0], [5, 1]]);
    }
}
