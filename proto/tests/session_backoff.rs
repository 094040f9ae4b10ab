//! The agent's reconnect policy, with a deterministic jitter source and a virtual clock.

use std::time::Duration;

use flotilla_proto::session::{Backoff, BackoffConfig, Jitter, MIN_HUB_DELAY};
use tokio::time::Instant;

const SECOND: Duration = Duration::from_secs(1);

fn config() -> BackoffConfig {
    BackoffConfig {
        initial: SECOND,
        max: Duration::from_secs(60),
        startup_jitter: Duration::from_secs(10),
        stable_after: Duration::from_secs(120),
        max_retry_after: Duration::from_secs(600),
    }
}

/// Draws `max * fraction` for each fraction in turn (cycling), and records every `max` asked
/// for, so a test sees both the window and where in it the delay fell.
struct Fractions {
    fractions: Vec<f64>,
    next: usize,
    asked: Vec<Duration>,
}

impl Fractions {
    fn new(fractions: &[f64]) -> Self {
        Self {
            fractions: fractions.to_vec(),
            next: 0,
            asked: Vec::new(),
        }
    }
}

impl Jitter for Fractions {
    fn uniform(&mut self, max: Duration) -> Duration {
        self.asked.push(max);
        let f = self.fractions[self.next % self.fractions.len()];
        self.next += 1;
        max.mul_f64(f)
    }
}

fn secs(s: &[u64]) -> Vec<Duration> {
    s.iter().map(|&s| Duration::from_secs(s)).collect()
}

#[test]
fn ceiling_doubles_up_to_the_cap() {
    let now = Instant::now();
    let mut backoff = Backoff::new(config());
    let mut top = Fractions::new(&[1.0]);

    let delays: Vec<_> = (0..9)
        .map(|_| backoff.next_delay(now, None, &mut top))
        .collect();

    assert_eq!(delays, secs(&[1, 2, 4, 8, 16, 32, 60, 60, 60]));
}

#[test]
fn many_failures_stay_at_the_cap() {
    let now = Instant::now();
    let mut backoff = Backoff::new(config());
    for _ in 0..1_000 {
        backoff.next_delay(now, None, &mut |max| max);
    }
    assert_eq!(backoff.ceiling(), Duration::from_secs(60));
}

#[test]
fn full_jitter_draws_from_zero_to_the_ceiling() {
    let now = Instant::now();
    let mut backoff = Backoff::new(config());
    let mut jitter = Fractions::new(&[0.0, 0.5, 0.25, 1.0]);

    let delays: Vec<_> = (0..4)
        .map(|_| backoff.next_delay(now, None, &mut jitter))
        .collect();

    assert_eq!(
        jitter.asked,
        secs(&[1, 2, 4, 8]),
        "the window is [0, ceiling]"
    );
    assert_eq!(
        delays,
        vec![Duration::ZERO, SECOND, SECOND, Duration::from_secs(8)]
    );
}

#[test]
fn a_jitter_source_out_of_range_is_clamped() {
    let now = Instant::now();
    let mut backoff = Backoff::new(config());
    let delay = backoff.next_delay(now, None, &mut |max: Duration| max * 10);
    assert_eq!(delay, SECOND);
}

#[test]
fn startup_delay_spreads_a_fleet_over_the_startup_window() {
    let backoff = Backoff::new(config());
    let mut jitter = Fractions::new(&[0.0, 0.3, 1.0]);

    let delays: Vec<_> = (0..3).map(|_| backoff.startup_delay(&mut jitter)).collect();

    assert_eq!(jitter.asked, secs(&[10, 10, 10]));
    assert_eq!(delays, secs(&[0, 3, 10]));
    assert_eq!(backoff.attempt(), 0, "starting up is not a failure");
}

#[test]
fn retry_after_from_the_hub_is_honoured() {
    let now = Instant::now();
    let check = |fraction: f64, retry_after: u64, expected: Duration| {
        let mut backoff = Backoff::new(config());
        // Two failures first: the window is [0, 4s].
        backoff.next_delay(now, None, &mut |max| max);
        backoff.next_delay(now, None, &mut |max| max);
        let delay = backoff.next_delay(
            now,
            Some(Duration::from_secs(retry_after)),
            &mut |max: Duration| max.mul_f64(fraction),
        );
        assert_eq!(
            delay, expected,
            "fraction {fraction}, retry-after {retry_after}s"
        );
    };

    // The hub's delay wins when it is longer than the jittered one ...
    check(0.5, 45, Duration::from_secs(45));
    // ... the jittered one when it is longer ...
    check(1.0, 3, Duration::from_secs(4));
    // ... and an absurd retry-after is limited.
    check(0.0, 86_400, Duration::from_secs(600));
}

#[test]
fn the_time_the_hub_gives_is_taken_whatever_the_climb() {
    let now = Instant::now();
    let check = |retry_after: Duration, expected: Duration| {
        let mut backoff = Backoff::new(config());
        // Four failures first: the window is [0, 16s].
        for _ in 0..4 {
            backoff.next_delay(now, None, &mut |max| max);
        }
        assert_eq!(
            backoff.hub_delay(now, retry_after),
            expected,
            "{retry_after:?}"
        );
    };
    // Shorter than the window: the hub's time, not a draw from the window ...
    check(Duration::from_secs(3), Duration::from_secs(3));
    // ... an absurd retry-after is limited ...
    check(Duration::from_secs(86_400), Duration::from_secs(600));
    // ... and "now" is not taken literally.
    check(Duration::ZERO, MIN_HUB_DELAY);
}

#[test]
fn a_hub_turning_an_agent_away_does_not_make_it_climb() {
    let now = Instant::now();
    let mut backoff = Backoff::new(config());
    backoff.next_delay(now, None, &mut |max| max);
    // Turned away ten times, each told to come back in 200 ms: each wait is the hub's, and
    // the next failure without an answer climbs from where it was.
    for _ in 0..10 {
        let delay = backoff.hub_delay(now, Duration::from_millis(200));
        assert_eq!(delay, Duration::from_millis(200));
    }
    assert_eq!(backoff.attempt(), 1);
    assert_eq!(
        backoff.next_delay(now, None, &mut |max| max),
        Duration::from_secs(2)
    );
}

#[test]
fn a_stable_connection_resets_the_climb() {
    let start = Instant::now();
    let mut backoff = Backoff::new(config());
    for _ in 0..5 {
        backoff.next_delay(start, None, &mut |max| max);
    }
    assert_eq!(backoff.ceiling(), Duration::from_secs(32));

    backoff.connected(start);
    let delay = backoff.next_delay(start + Duration::from_secs(120), None, &mut |max| max);

    assert_eq!(
        delay, SECOND,
        "after a stable period the next delay is small again"
    );
    assert_eq!(backoff.attempt(), 1);
}

#[test]
fn a_short_lived_connection_does_not_reset_the_climb() {
    let start = Instant::now();
    let mut backoff = Backoff::new(config());
    for _ in 0..5 {
        backoff.next_delay(start, None, &mut |max| max);
    }

    backoff.connected(start);
    let delay = backoff.next_delay(start + Duration::from_secs(119), None, &mut |max| max);

    assert_eq!(delay, Duration::from_secs(32));
}

#[test]
fn time_spent_disconnected_is_not_stability() {
    let start = Instant::now();
    let mut backoff = Backoff::new(config());
    for _ in 0..5 {
        backoff.next_delay(start, None, &mut |max| max);
    }
    // A connection came up and was judged once; a later failure without a new connection
    // (a refused dial) keeps climbing however much time passed.
    backoff.connected(start);
    backoff.next_delay(start + Duration::from_secs(10), None, &mut |max| max);
    let delay = backoff.next_delay(start + Duration::from_secs(3600), None, &mut |max| max);

    assert_eq!(delay, Duration::from_secs(60));
}

#[test]
fn a_drained_agent_on_a_healthy_link_comes_back_at_the_hubs_time() {
    let start = Instant::now();
    let mut backoff = Backoff::new(config());
    backoff.connected(start);

    let delay = backoff.next_delay(
        start + Duration::from_secs(3600),
        Some(Duration::from_secs(20)),
        &mut |max: Duration| max / 2,
    );

    assert_eq!(delay, Duration::from_secs(20));
}
