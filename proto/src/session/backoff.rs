//! How long an agent waits before reconnecting: exponential backoff with full jitter, an initial
//! jitter after process start, the hub's retry-after honoured, and a reset once a connection
//! has proved stable.
//!
//! Pure: time is passed in and randomness comes from a [`Jitter`] the caller provides, so the
//! policy is tested with a fixed sequence and the agent plugs in a real RNG.

use std::time::Duration;

use tokio::time::Instant;

/// Default for [`BackoffConfig::initial`].
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_secs(1);
/// Default for [`BackoffConfig::max`].
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(120);
/// Default for [`BackoffConfig::startup_jitter`].
pub const DEFAULT_STARTUP_JITTER: Duration = Duration::from_secs(10);
/// Default for [`BackoffConfig::stable_after`].
pub const DEFAULT_STABLE_AFTER: Duration = Duration::from_secs(120);
/// Default for [`BackoffConfig::max_retry_after`].
pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(15 * 60);

/// The least delay an agent takes when the hub gives one: a hub that keeps answering "now"
/// (a bug, or a forged answer before TLS) gets at most ten dials a second from each agent.
pub const MIN_HUB_DELAY: Duration = Duration::from_millis(100);

/// A source of uniformly distributed delays.
///
/// Implemented for any `FnMut(Duration) -> Duration`, so the agent passes a closure over its
/// RNG (`&mut |max| rng.random_range(Duration::ZERO..=max)`) and tests pass a fixed sequence.
pub trait Jitter {
    /// A duration drawn uniformly from `[0, max]`. Values above `max` are clamped by callers.
    fn uniform(&mut self, max: Duration) -> Duration;
}

impl<F: FnMut(Duration) -> Duration> Jitter for F {
    fn uniform(&mut self, max: Duration) -> Duration {
        self(max)
    }
}

/// No jitter: every delay is the bottom of its range, so a run repeats exactly (tests).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoJitter;

impl Jitter for NoJitter {
    fn uniform(&mut self, _max: Duration) -> Duration {
        Duration::ZERO
    }
}

/// The reconnect policy's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffConfig {
    /// The ceiling of the first delay; each further failure doubles it.
    pub initial: Duration,
    /// The largest ceiling: however long the hub is away, an agent tries at least this often.
    pub max: Duration,
    /// The ceiling of the delay before the first connection after the process starts, so that
    /// a fleet restarted together (a rollout, a power cut at a site) does not dial at once.
    pub startup_jitter: Duration,
    /// A connection that stayed up this long counts as healthy: the next failure starts again
    /// from `initial` instead of continuing the previous climb.
    pub stable_after: Duration,
    /// The most of a hub's retry-after that is obeyed, so that a misconfigured gateway cannot
    /// park its agents for days.
    pub max_retry_after: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            initial: DEFAULT_BACKOFF_INITIAL,
            max: DEFAULT_BACKOFF_MAX,
            startup_jitter: DEFAULT_STARTUP_JITTER,
            stable_after: DEFAULT_STABLE_AFTER,
            max_retry_after: DEFAULT_MAX_RETRY_AFTER,
        }
    }
}

/// Exponential backoff with full jitter that resets after a stable connection, in the manner of
/// kube-runtime's `ResetTimerBackoff`.
///
/// Full jitter (a delay drawn from `[0, ceiling]`, not `ceiling ± x`) is what spreads a fleet
/// whose sessions all dropped at the same instant across the whole window, so that the
/// gateways' admission sees a rate instead of a wall.
#[derive(Debug, Clone)]
pub struct Backoff {
    config: BackoffConfig,
    /// Failures since the last reset; the ceiling is `initial * 2^attempt`, capped at `max`.
    attempt: u32,
    /// When the current connection was established, if one is up; checked against
    /// `stable_after` when it fails.
    connected_at: Option<Instant>,
}

impl Backoff {
    /// A policy with no failures yet.
    pub fn new(config: BackoffConfig) -> Self {
        Self {
            config,
            attempt: 0,
            connected_at: None,
        }
    }

    /// The delay before the first connection after the process starts: uniform in
    /// `[0, startup_jitter]`.
    pub fn startup_delay(&self, jitter: &mut (impl Jitter + ?Sized)) -> Duration {
        draw(jitter, self.config.startup_jitter)
    }

    /// Records that a session was established at `now` (on the welcome, not on TCP connect:
    /// a gateway that accepts and then refuses has not given a healthy connection).
    pub fn connected(&mut self, now: Instant) {
        self.connected_at = Some(now);
    }

    /// The hub gave this agent its time at `now` (a drain, or a dial turned away before TLS):
    /// how long to wait. It is `retry_after`, limited to `max_retry_after` and at least
    /// [`MIN_HUB_DELAY`], and no failure counts, as gRPC's retry pushback replaces the client's
    /// backoff. The hub spreads the times it gives (future slots of its rate, a drain's
    /// window); a draw from a climbed window on top sent an agent turned away a few times far
    /// past its slot.
    pub fn hub_delay(&mut self, now: Instant, retry_after: Duration) -> Duration {
        if let Some(since) = self.connected_at.take()
            && now.saturating_duration_since(since) >= self.config.stable_after
        {
            self.attempt = 0;
        }
        retry_after
            .min(self.config.max_retry_after)
            .max(MIN_HUB_DELAY)
    }

    /// The connection failed or closed at `now`: how long to wait before the next attempt.
    ///
    /// If the connection that just ended had been up for `stable_after`, the climb starts
    /// over. The delay is uniform in `[0, min(max, initial * 2^failures)]`; with a
    /// `retry_after` from the hub that is not the agent's time (a redirect too many) it is
    /// `max(retry_after, that)`, with `retry_after` limited to `max_retry_after`.
    pub fn next_delay(
        &mut self,
        now: Instant,
        retry_after: Option<Duration>,
        jitter: &mut (impl Jitter + ?Sized),
    ) -> Duration {
        if let Some(since) = self.connected_at.take()
            && now.saturating_duration_since(since) >= self.config.stable_after
        {
            self.attempt = 0;
        }
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let delay = draw(jitter, ceiling);
        match retry_after {
            Some(asked) => delay.max(asked.min(self.config.max_retry_after)),
            None => delay,
        }
    }

    /// Failures counted since the last reset.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The upper bound of the next delay (before any retry-after).
    pub fn ceiling(&self) -> Duration {
        // 2^31 of any useful `initial` is far beyond any `max`; stopping there avoids overflow.
        let factor = 1u32 << self.attempt.min(31);
        self.config
            .initial
            .checked_mul(factor)
            .unwrap_or(self.config.max)
            .min(self.config.max)
    }
}

fn draw(jitter: &mut (impl Jitter + ?Sized), max: Duration) -> Duration {
    jitter.uniform(max).min(max)
}
