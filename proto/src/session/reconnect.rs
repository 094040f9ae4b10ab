//! Where the agent's connection to the hub stands, and where and when it dials next: the
//! reconnect policy as an explicit state machine, in the manner of linkerd's `reconnect`,
//! with no IO and no clock (`now` comes in, a target and a delay go out).
//!
//! ```text
//!                      connect (once due)                  established
//!  Disconnected { until } ───────────► Connecting { target, redirects } ──────────► Connected { since }
//!           ▲                                   │                                        │
//!           └────────────── ended ──────────────┴──────────────── ended ─────────────────┘
//! ```
//!
//! The agent's driver waits until [`Reconnect::poll_timeout`], takes the target from
//! [`Reconnect::connect`], dials it, says [`Reconnect::established`] on the hub's welcome, and
//! tells [`Reconnect::ended`] how the session (or the attempt at one) ended, as a
//! [`SessionEnd`]; the answer is the next target and the delay before it.
//!
//! The policy, each rule as a reconnect storm taught it:
//!
//! 1. **Backoff.** Failures wait for [`Backoff`]'s delay: full jitter, a startup jitter, a reset
//!    after a stable session, the hub's retry-after obeyed. Only a session that got as far as
//!    the welcome counts towards a stable one.
//! 2. **Redirects.** A drain that names the gateway owning this cluster's shard is followed
//!    there after the drain's own (short) delay, without backoff: the owner is known to be
//!    up. At most [`MAX_REDIRECTS`] in a row without a session established: two gateways that
//!    disagree on ownership must not bounce an agent between them forever; past it the drain
//!    is backed off like any other and the agent dials its configured address. A failure at a
//!    redirect target also brings the agent back (no redirect is kept across a failure).
//! 3. **Home.** The gateway that a redirect brought the last established session to is
//!    dialled first next time: a gateway restarted in place still owns the shard, and the
//!    configured address would only redirect there again, a second TLS handshake per agent in
//!    a storm. It is given up after [`HOME_DIAL_ATTEMPTS`] dials in a row that do not
//!    establish (a restarting gateway closes connections until it has loaded its shards, so a
//!    few misses are expected; forgetting it at the first one sent a 50,000-agent storm
//!    through 76,630 redirects), and at once when nothing listens or answers there
//!    ([`SessionEnd::Unreachable`]: that gateway is gone, not cold).

use std::time::Duration;

use tokio::time::Instant;

use super::{Backoff, BackoffConfig, Jitter};

/// Redirects followed in a row without a session established: past it the agent goes back to
/// its configured address (two gateways that disagree on ownership must not bounce it between
/// them forever).
pub const MAX_REDIRECTS: u32 = 3;

/// Dials in a row to the gateway of the last session that may fail before the agent goes back
/// to its configured address: a gateway restarted in place closes connections until it has
/// loaded its shards, and going elsewhere would only cost a redirect back to it. A dial that
/// finds nothing listening there gives up on it at once.
pub const HOME_DIAL_ATTEMPTS: u32 = 3;

/// Where the next dial goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The address the agent was configured with: whichever gateway answers there sends the
    /// agent on to its shard's owner.
    Configured,
    /// The gateway that owns this cluster's shard, as the drain of another one named it.
    Redirect(String),
    /// The gateway of the last session (reached by a redirect), dialled first again.
    Home(String),
}

impl Target {
    /// The gateway's address, or `None` for the configured address.
    pub fn address(&self) -> Option<&str> {
        match self {
            Target::Configured => None,
            Target::Redirect(address) | Target::Home(address) => Some(address),
        }
    }
}

/// How a session, or an attempt at one, ended: as much as the reconnect policy needs to know.
/// The agent's own shutdown is not one: the agent simply stops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// The hub drained the session (shutting down, handing the shard over, over its
    /// new-session rate): come back after `retry_after`, at `redirect` when it named the
    /// gateway that owns this cluster's shard.
    Drained {
        /// The hub's delay.
        retry_after: Duration,
        /// The shard owner's address.
        redirect: Option<String>,
    },
    /// Nothing listened or answered at the address dialled (connection refused, no route,
    /// the dial timed out): that gateway is gone, not merely cold.
    Unreachable,
    /// Anything else: the connection closed or was reset before the welcome (a gateway still
    /// loading its shards does that), the hub refused the session, or an established session
    /// was lost.
    Lost,
}

/// What [`Reconnect::ended`] decided: after `delay`, dial `target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Next {
    /// How long to wait before dialling.
    pub delay: Duration,
    /// Where the dial goes.
    pub target: Target,
}

/// Where the connection stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Waiting until `until` before the next dial, which goes to `next`.
    Disconnected {
        /// When the next dial is due.
        until: Instant,
        /// Where it goes.
        next: Target,
        /// Redirects followed in a row so far, `next` included when it is one.
        redirects: u32,
    },
    /// Dialling `target` and saying hello; `redirects` in a row led here.
    Connecting {
        /// The gateway being dialled.
        target: Target,
        /// Redirects followed in a row without a session established.
        redirects: u32,
    },
    /// The hub welcomed the session at `since`.
    Connected {
        /// When the welcome arrived; a session up for the backoff's stable period resets it.
        since: Instant,
    },
}

/// The agent's reconnect policy: the backoff, the redirect count, the home gateway and its
/// misses, decided in one place. See the module doc.
#[derive(Debug, Clone)]
pub struct Reconnect {
    state: State,
    backoff: Backoff,
    /// The gateway a redirect brought the last established session to, if any.
    home: Option<String>,
    /// Dials to `home` in a row that did not establish.
    home_misses: u32,
}

impl Reconnect {
    /// A machine for a process that has just started: disconnected for the startup jitter, so
    /// a fleet restarted together does not dial at once, then the configured address.
    pub fn new(now: Instant, config: BackoffConfig, jitter: &mut (impl Jitter + ?Sized)) -> Self {
        let backoff = Backoff::new(config);
        let delay = backoff.startup_delay(jitter);
        Self {
            state: State::Disconnected {
                until: now + delay,
                next: Target::Configured,
                redirects: 0,
            },
            backoff,
            home: None,
            home_misses: 0,
        }
    }

    /// Where the connection stands.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Whether the hub has welcomed the session under way.
    pub fn is_connected(&self) -> bool {
        matches!(self.state, State::Connected { .. })
    }

    /// The gateway dialled first after a failure, if a redirect brought the last session there.
    pub fn home(&self) -> Option<&str> {
        self.home.as_deref()
    }

    /// When the next dial is due, while disconnected.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Disconnected { until, .. } => Some(until),
            State::Connecting { .. } | State::Connected { .. } => None,
        }
    }

    /// Starts the next dial if it is due: `Disconnected` → `Connecting`, returning where to
    /// dial. `None` before the delay has passed, or when a dial or session is already under way.
    pub fn connect(&mut self, now: Instant) -> Option<Target> {
        match &self.state {
            State::Disconnected {
                until,
                next,
                redirects,
            } if now >= *until => {
                let target = next.clone();
                self.state = State::Connecting {
                    target: target.clone(),
                    redirects: *redirects,
                };
                Some(target)
            }
            _ => None,
        }
    }

    /// The hub welcomed the session at `now`: `Connecting` → `Connected`. The gateway it was
    /// reached at becomes home (the configured address clears it), since it owns the shard;
    /// the redirect count and the home's misses start again. Ignored in other states.
    pub fn established(&mut self, now: Instant) {
        let State::Connecting { target, .. } = &self.state else {
            return;
        };
        self.home = target.address().map(str::to_owned);
        self.home_misses = 0;
        self.backoff.connected(now);
        self.state = State::Connected { since: now };
    }

    /// The session, or the dial, ended at `now` as `end` says: `Connecting`/`Connected` →
    /// `Disconnected`, with the next target and the delay before it. Called while already
    /// disconnected, it changes nothing and answers the wait under way.
    pub fn ended(
        &mut self,
        now: Instant,
        end: SessionEnd,
        jitter: &mut (impl Jitter + ?Sized),
    ) -> Next {
        let (target, redirects) = match &self.state {
            State::Disconnected {
                until,
                next,
                redirects: _,
            } => {
                return Next {
                    delay: until.saturating_duration_since(now),
                    target: next.clone(),
                };
            }
            State::Connecting { target, redirects } => (Some(target.clone()), *redirects),
            // A session was established: redirects counted before it do not count any more.
            State::Connected { .. } => (None, 0),
        };
        // A dial to home that failed is one of its misses; one that found nothing there gives
        // it up at once (the gateway is gone, not cold). A drain is an answer, not a miss.
        if let Some(target) = &target
            && matches!(end, SessionEnd::Unreachable | SessionEnd::Lost)
            && self.home.is_some()
            && target.address() == self.home.as_deref()
        {
            self.home_misses += 1;
            if end == SessionEnd::Unreachable || self.home_misses >= HOME_DIAL_ATTEMPTS {
                self.home = None;
                self.home_misses = 0;
            }
        }
        let (delay, next, redirects) = match end {
            // The gateway reached does not own this cluster's shard and named the one that
            // does: go there after the drain's delay, no backoff, unless this has happened
            // too often in a row.
            SessionEnd::Drained {
                retry_after,
                redirect: Some(to),
            } if redirects < MAX_REDIRECTS => (retry_after, Target::Redirect(to), redirects + 1),
            // One redirect too many: the gateways disagree, which is a failure: the hub's
            // delay or the backoff's if longer, then home or the configured address.
            SessionEnd::Drained {
                retry_after,
                redirect: Some(_),
            } => (
                self.backoff.next_delay(now, Some(retry_after), jitter),
                self.fallback(),
                0,
            ),
            // A drain, or a dial turned away: the time the hub gave, then home or the
            // configured address.
            SessionEnd::Drained {
                retry_after,
                redirect: None,
            } => (self.backoff.hub_delay(now, retry_after), self.fallback(), 0),
            // A failure, at a redirect target too: back off, then home or the configured
            // address.
            SessionEnd::Unreachable | SessionEnd::Lost => (
                self.backoff.next_delay(now, None, jitter),
                self.fallback(),
                0,
            ),
        };
        self.state = State::Disconnected {
            until: now + delay,
            next: next.clone(),
            redirects,
        };
        Next {
            delay,
            target: next,
        }
    }

    /// Where a dial goes when no redirect leads it: home if there is one, else the configured
    /// address.
    fn fallback(&self) -> Target {
        match &self.home {
            Some(home) => Target::Home(home.clone()),
            None => Target::Configured,
        }
    }
}

#[cfg(test)]
mod tests {
    //! The policy against a simulated fleet on a virtual clock: each gateway answers a dial
    //! the way the storms found them answering, and a test reads the dials the agent makes.

    use std::collections::HashMap;

    use super::*;

    const SECOND: Duration = Duration::from_secs(1);
    /// The agent's configured address, as the simulated fleet knows it.
    const CONFIGURED: &str = "configured";

    fn config() -> BackoffConfig {
        BackoffConfig {
            initial: SECOND,
            max: Duration::from_secs(60),
            startup_jitter: Duration::from_secs(10),
            stable_after: Duration::from_secs(120),
            max_retry_after: Duration::from_secs(600),
        }
    }

    /// Every delay drawn at its ceiling, so a test can say how long each wait is.
    fn ceiling(max: Duration) -> Duration {
        max
    }

    /// What a gateway does with a dial.
    #[derive(Debug, Clone)]
    enum Gateway {
        /// Owns the shard: the session is established and later lost.
        Owner,
        /// Restarted and loading its shards: closes this many connections, then owns.
        Cold(u32),
        /// Nothing listens there.
        Gone,
        /// Drains every session with a redirect to this address.
        RedirectsTo(&'static str, Duration),
        /// Drains every session with this retry-after and no redirect.
        Draining(Duration),
        /// Owns the shard, then hands it over: the session is established, then drained with
        /// a redirect to the new owner.
        HandsOver(&'static str),
    }

    /// A fleet of gateways by address and an agent's reconnect machine on a virtual clock.
    struct Sim {
        now: Instant,
        gateways: HashMap<&'static str, Gateway>,
        machine: Reconnect,
        /// Each dial: where it went and how long the agent had waited for it.
        dials: Vec<(String, Duration)>,
    }

    impl Sim {
        fn new(gateways: &[(&'static str, Gateway)]) -> Sim {
            let now = Instant::now();
            let machine = Reconnect::new(now, config(), &mut |_| Duration::ZERO);
            Sim {
                now,
                gateways: gateways.iter().cloned().collect(),
                machine,
                dials: Vec::new(),
            }
        }

        /// Waits for the next dial, makes it, and ends it as the gateway there does. A session
        /// an owner establishes stays up `up` and is then lost.
        fn dial(&mut self, up: Duration) -> String {
            let due = self
                .machine
                .poll_timeout()
                .expect("disconnected between dials");
            let waited = due.saturating_duration_since(self.now);
            if !waited.is_zero() {
                assert_eq!(
                    self.machine.connect(self.now),
                    None,
                    "not due before its delay"
                );
            }
            self.now = due;
            let target = self.machine.connect(self.now).expect("due");
            let address = target.address().unwrap_or(CONFIGURED).to_string();
            self.dials.push((address.clone(), waited));
            let gateway = self
                .gateways
                .get_mut(address.as_str())
                .expect("known address");
            let end = match gateway {
                Gateway::Owner => {
                    self.machine.established(self.now);
                    self.now += up;
                    SessionEnd::Lost
                }
                Gateway::Cold(0) => {
                    *gateway = Gateway::Owner;
                    self.machine.established(self.now);
                    self.now += up;
                    SessionEnd::Lost
                }
                Gateway::Cold(closes) => {
                    *closes -= 1;
                    SessionEnd::Lost
                }
                Gateway::Gone => SessionEnd::Unreachable,
                Gateway::RedirectsTo(to, retry_after) => SessionEnd::Drained {
                    retry_after: *retry_after,
                    redirect: Some(to.to_string()),
                },
                Gateway::Draining(retry_after) => SessionEnd::Drained {
                    retry_after: *retry_after,
                    redirect: None,
                },
                Gateway::HandsOver(to) => {
                    self.machine.established(self.now);
                    self.now += up;
                    SessionEnd::Drained {
                        retry_after: HOP,
                        redirect: Some(to.to_string()),
                    }
                }
            };
            let next = self.machine.ended(self.now, end, &mut ceiling);
            assert_eq!(
                self.machine.poll_timeout(),
                Some(self.now + next.delay),
                "disconnected for the delay it answered"
            );
            address
        }

        /// `n` dials; the addresses they went to.
        fn dials(&mut self, n: usize, up: Duration) -> Vec<String> {
            (0..n).map(|_| self.dial(up)).collect()
        }

        fn waits(&self) -> Vec<Duration> {
            self.dials.iter().map(|(_, waited)| *waited).collect()
        }
    }

    fn secs(s: &[u64]) -> Vec<Duration> {
        s.iter().map(|&s| Duration::from_secs(s)).collect()
    }

    const HOP: Duration = Duration::from_millis(100);

    #[test]
    fn a_started_agent_waits_its_startup_jitter_then_dials_the_configured_address() {
        let now = Instant::now();
        let mut machine = Reconnect::new(now, config(), &mut |max: Duration| max / 2);
        assert_eq!(machine.poll_timeout(), Some(now + Duration::from_secs(5)));
        assert_eq!(machine.connect(now + Duration::from_secs(4)), None);
        assert_eq!(
            machine.connect(now + Duration::from_secs(5)),
            Some(Target::Configured)
        );
        assert!(matches!(
            machine.state(),
            State::Connecting { redirects: 0, .. }
        ));
        assert_eq!(machine.poll_timeout(), None);
        assert_eq!(
            machine.connect(now + Duration::from_secs(6)),
            None,
            "one dial at a time"
        );
    }

    #[test]
    fn a_redirect_is_followed_after_its_delay_and_its_gateway_becomes_home() {
        let mut sim = Sim::new(&[
            (CONFIGURED, Gateway::RedirectsTo("gw-2", HOP)),
            ("gw-2", Gateway::Owner),
        ]);
        // Redirected once, established at the owner; every later loss dials the owner first.
        assert_eq!(
            sim.dials(4, Duration::from_secs(1)),
            [CONFIGURED, "gw-2", "gw-2", "gw-2"]
        );
        assert_eq!(sim.machine.home(), Some("gw-2"));
        // The redirect costs its own delay, not a backoff; the losses climb the backoff (a
        // session up 1 s is not stable).
        assert_eq!(sim.waits(), [Duration::ZERO, HOP, SECOND, 2 * SECOND]);
    }

    #[test]
    fn a_cold_gateway_is_dialled_again_up_to_the_attempts_before_the_configured_address() {
        // Restarted in place, it closes two connections while it loads its shards: the agent
        // stays with it and never costs the configured address a redirect.
        let mut sim = Sim::new(&[
            (CONFIGURED, Gateway::RedirectsTo("gw-2", HOP)),
            ("gw-2", Gateway::Owner),
        ]);
        sim.dials(2, Duration::from_secs(1));
        sim.gateways
            .insert("gw-2", Gateway::Cold(HOME_DIAL_ATTEMPTS - 1));
        assert_eq!(
            sim.dials(HOME_DIAL_ATTEMPTS as usize, Duration::from_secs(1)),
            vec!["gw-2"; HOME_DIAL_ATTEMPTS as usize]
        );
        assert_eq!(sim.machine.home(), Some("gw-2"));

        // One that closes as many as the attempts is given up: the configured address
        // redirects the agent back to it, where it now serves.
        sim.gateways
            .insert("gw-2", Gateway::Cold(HOME_DIAL_ATTEMPTS));
        let dials = sim.dials(HOME_DIAL_ATTEMPTS as usize + 3, Duration::from_secs(1));
        let mut expected = vec!["gw-2"; HOME_DIAL_ATTEMPTS as usize];
        expected.extend([CONFIGURED, "gw-2", "gw-2"]);
        assert_eq!(dials, expected);
        assert_eq!(sim.machine.home(), Some("gw-2"));
    }

    #[test]
    fn a_gone_gateway_is_given_up_at_its_first_failed_dial() {
        let mut sim = Sim::new(&[
            (CONFIGURED, Gateway::RedirectsTo("gw-2", HOP)),
            ("gw-2", Gateway::Owner),
            ("gw-3", Gateway::Owner),
        ]);
        sim.dials(2, Duration::from_secs(1));
        // gw-2 is gone; its shard moved to gw-3, as the configured address now says.
        sim.gateways
            .insert(CONFIGURED, Gateway::RedirectsTo("gw-3", HOP));
        sim.gateways.insert("gw-2", Gateway::Gone);
        assert_eq!(
            sim.dials(3, Duration::from_secs(1)),
            ["gw-2", CONFIGURED, "gw-3"]
        );
        assert_eq!(sim.machine.home(), Some("gw-3"));
    }

    #[test]
    fn two_gateways_that_disagree_on_the_owner_bounce_the_agent_a_bounded_number_of_times() {
        let mut sim = Sim::new(&[
            (CONFIGURED, Gateway::RedirectsTo("gw-a", HOP)),
            ("gw-a", Gateway::RedirectsTo("gw-b", HOP)),
            ("gw-b", Gateway::RedirectsTo("gw-a", HOP)),
        ]);
        let dials = sim.dials(2 * (MAX_REDIRECTS as usize + 1), Duration::ZERO);
        // Three redirects in a row, then back to the configured address after the larger of
        // the backoff and the drain's delay.
        assert_eq!(
            dials,
            [
                CONFIGURED, "gw-a", "gw-b", "gw-a", CONFIGURED, "gw-a", "gw-b", "gw-a"
            ]
        );
        assert_eq!(
            sim.waits(),
            [Duration::ZERO, HOP, HOP, HOP, SECOND, HOP, HOP, HOP,]
        );
        assert_eq!(sim.machine.home(), None, "no session, no home");
        // And the next round backs off further: the backoff is not reset by a redirect.
        sim.dial(Duration::ZERO);
        assert_eq!(sim.waits().last(), Some(&(2 * SECOND)));
    }

    #[test]
    fn a_gateway_that_redirects_to_itself_is_left_after_the_bound() {
        let mut sim = Sim::new(&[
            (CONFIGURED, Gateway::RedirectsTo("gw-1", HOP)),
            ("gw-1", Gateway::RedirectsTo("gw-1", HOP)),
        ]);
        let dials = sim.dials(MAX_REDIRECTS as usize + 2, Duration::ZERO);
        assert_eq!(dials, [CONFIGURED, "gw-1", "gw-1", "gw-1", CONFIGURED]);
    }

    #[test]
    fn a_drain_is_obeyed_for_its_retry_after_and_home_is_kept() {
        let mut sim = Sim::new(&[
            (CONFIGURED, Gateway::RedirectsTo("gw-2", HOP)),
            ("gw-2", Gateway::Owner),
        ]);
        sim.dials(2, Duration::from_secs(1));
        // gw-2 shuts down with a spread retry-after: longer than any backoff so far.
        sim.gateways
            .insert("gw-2", Gateway::Draining(Duration::from_secs(30)));
        assert_eq!(sim.dials(2, Duration::ZERO), ["gw-2", "gw-2"]);
        // The backoff's ceiling (1 s after the loss) is below the retry-after: the drain wins.
        // A drain is an answer from home, not a miss: home is kept however often it drains.
        assert_eq!(sim.waits()[2..], [SECOND, Duration::from_secs(30)]);
        sim.dials(HOME_DIAL_ATTEMPTS as usize, Duration::ZERO);
        assert_eq!(sim.machine.home(), Some("gw-2"));
    }

    #[test]
    fn a_drain_of_a_session_with_a_redirect_follows_it_and_home_moves_there() {
        // A handover: gw-2 gives the shard to gw-3 and drains its session naming the new owner.
        let mut sim = Sim::new(&[
            (CONFIGURED, Gateway::RedirectsTo("gw-2", HOP)),
            ("gw-2", Gateway::Owner),
            ("gw-3", Gateway::Owner),
        ]);
        sim.dials(2, Duration::from_secs(1));
        sim.gateways.insert("gw-2", Gateway::HandsOver("gw-3"));
        assert_eq!(
            sim.dials(3, Duration::from_secs(1)),
            ["gw-2", "gw-3", "gw-3"]
        );
        assert_eq!(sim.machine.home(), Some("gw-3"));
    }

    #[test]
    fn a_failure_at_a_redirect_target_brings_the_agent_back_to_the_configured_address() {
        let mut sim = Sim::new(&[
            (CONFIGURED, Gateway::RedirectsTo("gw-9", HOP)),
            ("gw-9", Gateway::Gone),
        ]);
        assert_eq!(
            sim.dials(4, Duration::ZERO),
            [CONFIGURED, "gw-9", CONFIGURED, "gw-9"]
        );
        assert_eq!(sim.waits(), [Duration::ZERO, HOP, SECOND, HOP]);
    }

    #[test]
    fn a_stable_session_starts_the_backoff_over() {
        let mut sim = Sim::new(&[(CONFIGURED, Gateway::Owner)]);
        sim.dials(4, Duration::from_secs(1));
        assert_eq!(sim.waits(), secs(&[0, 1, 2, 4]));
        // Up for the stable period: the next loss waits the first ceiling again.
        sim.dial(config().stable_after);
        sim.dial(Duration::ZERO);
        assert_eq!(sim.waits()[4..], secs(&[8, 1]));
        assert!(matches!(sim.machine.state(), State::Disconnected { .. }));
    }
}
