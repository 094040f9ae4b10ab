//! What a link is asked to be: a [`LinkSpec`] (delay, jitter, loss, rate, flaps, reordering and
//! the delay line's bound), written as `delay=80ms,jitter=20ms,loss=0.5%,rate=20mbit,flap=10s/60s`
//! or named by a [`Profile`].
//!
//! Delay and jitter are **round-trip** figures, as links are usually described ("RTT 80 ms ±
//! 20"): each direction holds a packet for half the delay, plus a uniform offset within ± half
//! the jitter, so one round trip lies within `delay ± jitter`. Loss and rate apply to **each
//! direction** on its own, as on a real path: a packet crossing the link is lost with the given
//! probability whichever way it goes (so a request and its answer are lost together about twice
//! as often), and each direction has the given bottleneck rate.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Bound of each direction's delay line, in packets, unless a spec says `queue=`.
pub const DEFAULT_QUEUE_PACKETS: usize = 4096;
/// Bound of each direction's delay line, in bytes: above the bandwidth-delay product of every
/// profile (satellite: 5 Mbit/s × 325 ms ≈ 200 KiB each way) with room for bursts.
pub const DEFAULT_QUEUE_BYTES: usize = 4 << 20;
/// The longest delay a spec may ask: past it a link is not slow, it is down (say `flap=`).
pub const MAX_DELAY: Duration = Duration::from_secs(10);
/// Loss is kept in parts per million: the finest step `numgen random mod` is asked for.
pub const LOSS_SCALE: u32 = 1_000_000;

/// What one emulated link does to the packets crossing it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkSpec {
    /// Round-trip delay: each direction holds every packet for half of it.
    pub delay: Duration,
    /// Round-trip jitter: each direction adds a uniform random offset within ± half of it to
    /// its half of the delay. At most `delay`, so no packet is held for less than nothing.
    pub jitter: Duration,
    /// The chance that a packet is dropped, each direction on its own.
    pub loss: Loss,
    /// The bottleneck rate of each direction; `None` leaves the link unshaped.
    pub rate: Option<Rate>,
    /// Outages on a schedule: everything dropped both ways for `down`, once every `every`.
    pub flap: Option<Flap>,
    /// Whether a packet may overtake one held longer (each keeps its own delay); without it a
    /// packet waits for the one before it, as on a single path.
    pub reorder: bool,
    /// The most packets and bytes each direction's delay line holds; a packet arriving when it
    /// is full is dropped and counted, like a tail drop in a router's buffer.
    pub queue: QueueBound,
}

/// A probability of loss, in parts per million.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Loss {
    pub per_million: u32,
}

/// A rate in bits per second (never zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub bits_per_second: u64,
}

/// A recurring outage: the link is up for `every - down`, then down for `down`, and again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flap {
    pub down: Duration,
    pub every: Duration,
}

/// The bound of one direction's delay line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueBound {
    pub packets: usize,
    pub bytes: usize,
}

impl Default for QueueBound {
    fn default() -> Self {
        QueueBound {
            packets: DEFAULT_QUEUE_PACKETS,
            bytes: DEFAULT_QUEUE_BYTES,
        }
    }
}

/// The named links of issue 28's measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Profile {
    /// A local network: 1 ms round trip, no loss, unshaped. The emulator's own overhead shows
    /// here, nothing else.
    Lan,
    /// Mobile broadband: 80 ms ± 20 round trip, 0.5 % loss, 20 Mbit/s.
    Lte,
    /// A congested DSL line: 300 ms ± 100 round trip, 3 % loss, 2 Mbit/s.
    Congested,
    /// Geostationary satellite: 650 ms round trip, 1 % loss, 5 Mbit/s.
    Satellite,
    /// `lte` that goes down for 10 s every 60 s.
    Flapping,
}

impl Profile {
    pub const ALL: [Profile; 5] = [
        Profile::Lan,
        Profile::Lte,
        Profile::Congested,
        Profile::Satellite,
        Profile::Flapping,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Profile::Lan => "lan",
            Profile::Lte => "lte",
            Profile::Congested => "congested",
            Profile::Satellite => "satellite",
            Profile::Flapping => "flapping",
        }
    }

    /// What the profile stands for, in a sentence an operator reads in `--help`.
    pub fn about(self) -> &'static str {
        match self {
            Profile::Lan => "a local network: 1 ms round trip, no loss, unshaped",
            Profile::Lte => "mobile broadband: 80 ms ± 20 round trip, 0.5 % loss, 20 Mbit/s",
            Profile::Congested => {
                "a congested DSL line: 300 ms ± 100 round trip, 3 % loss, 2 Mbit/s"
            }
            Profile::Satellite => "geostationary satellite: 650 ms round trip, 1 % loss, 5 Mbit/s",
            Profile::Flapping => "lte that goes down (everything dropped) for 10 s every 60 s",
        }
    }

    pub fn spec(self) -> LinkSpec {
        let ms = Duration::from_millis;
        let base = LinkSpec::default();
        match self {
            Profile::Lan => LinkSpec {
                delay: ms(1),
                ..base
            },
            Profile::Lte => LinkSpec {
                delay: ms(80),
                jitter: ms(20),
                loss: Loss::percent_tenths(5),
                rate: Some(Rate::mbit(20)),
                ..base
            },
            Profile::Congested => LinkSpec {
                delay: ms(300),
                jitter: ms(100),
                loss: Loss::percent_tenths(30),
                rate: Some(Rate::mbit(2)),
                ..base
            },
            Profile::Satellite => LinkSpec {
                delay: ms(650),
                loss: Loss::percent_tenths(10),
                rate: Some(Rate::mbit(5)),
                ..base
            },
            Profile::Flapping => LinkSpec {
                flap: Some(Flap {
                    down: Duration::from_secs(10),
                    every: Duration::from_secs(60),
                }),
                ..Profile::Lte.spec()
            },
        }
    }

    /// One line per profile, for `--help`.
    pub fn help() -> String {
        Profile::ALL
            .iter()
            .map(|p| format!("{}: {}", p.name(), p.about()))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Profile {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Profile::ALL
            .into_iter()
            .find(|p| p.name() == s.trim())
            .ok_or_else(|| SpecError::UnknownProfile {
                name: s.trim().to_string(),
            })
    }
}

impl Default for LinkSpec {
    /// A link that does nothing to its packets (an unshaped path through the emulator).
    fn default() -> Self {
        LinkSpec {
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: Loss::default(),
            rate: None,
            flap: None,
            reorder: false,
            queue: QueueBound::default(),
        }
    }
}

impl LinkSpec {
    /// The hold of each direction before jitter: half the round trip.
    pub fn one_way_delay(&self) -> Duration {
        self.delay / 2
    }

    /// The largest offset jitter adds to or takes from each direction's hold.
    pub fn one_way_jitter(&self) -> Duration {
        self.jitter / 2
    }

    /// The shortest round trip the link allows: no packet crosses it faster.
    pub fn min_round_trip(&self) -> Duration {
        2 * (self.one_way_delay() - self.one_way_jitter())
    }

    /// The chance that a request and its answer both cross: `(1 - loss)²`.
    pub fn round_trip_delivery(&self) -> f64 {
        (1.0 - self.loss.fraction()).powi(2)
    }

    fn check(&self) -> Result<(), SpecError> {
        if self.jitter > self.delay {
            return Err(SpecError::JitterAboveDelay {
                jitter: self.jitter,
                delay: self.delay,
            });
        }
        Ok(())
    }
}

impl fmt::Display for LinkSpec {
    /// The canonical spec, which parses back to the same link.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "delay={},jitter={},loss={}",
            humantime::format_duration(self.delay),
            humantime::format_duration(self.jitter),
            self.loss
        )?;
        if let Some(rate) = self.rate {
            write!(f, ",rate={rate}")?;
        }
        if let Some(flap) = self.flap {
            write!(f, ",flap={flap}")?;
        }
        if self.reorder {
            f.write_str(",reorder=on")?;
        }
        if self.queue != QueueBound::default() {
            write!(f, ",queue={}", self.queue.packets)?;
        }
        Ok(())
    }
}

/// The keys a spec may have, for the error that names an unknown one.
const KEYS: &str = "delay, jitter, loss, rate, flap, reorder, queue";

impl FromStr for LinkSpec {
    type Err = SpecError;

    /// `[PROFILE,]key=value,...`: a profile's link with some keys changed, or the keys alone
    /// on an unshaped link. A key given twice is refused rather than one of them ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let items: Vec<&str> = s.split(',').map(str::trim).collect();
        if items.iter().all(|i| i.is_empty()) {
            return Err(SpecError::Empty);
        }
        let (mut spec, rest) = match items[0] {
            first if !first.contains('=') && first != "reorder" => {
                (first.parse::<Profile>()?.spec(), &items[1..])
            }
            _ => (LinkSpec::default(), &items[..]),
        };
        let mut seen: Vec<&str> = Vec::new();
        for item in rest {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None if *item == "reorder" => ("reorder", "on"),
                None => {
                    return Err(SpecError::UnknownKey {
                        key: item.to_string(),
                    });
                }
            };
            if seen.contains(&key) {
                return Err(SpecError::Repeated {
                    key: key.to_string(),
                });
            }
            let bad = |expected: &'static str| SpecError::BadValue {
                key: key.to_string(),
                value: value.to_string(),
                expected,
            };
            match key {
                "delay" => {
                    spec.delay = parse_delay(value)
                        .ok_or_else(|| bad("a round-trip duration up to 10s, such as 80ms or 1.5s"))?
                }
                "jitter" => {
                    spec.jitter = parse_delay(value)
                        .ok_or_else(|| bad("a round-trip duration up to 10s, such as 20ms"))?
                }
                "loss" => {
                    spec.loss = value.parse().map_err(|_| {
                        bad("a percentage from 0% to 100% (each direction), such as 0.5%")
                    })?
                }
                "rate" => {
                    spec.rate = match value {
                        "unlimited" | "off" => None,
                        v => Some(v.parse().map_err(|_| {
                            bad("a rate such as 20mbit, 500kbit or 1gbit (each direction), or unlimited")
                        })?),
                    }
                }
                "flap" => {
                    spec.flap = match value {
                        "off" | "none" => None,
                        v => Some(v.parse().map_err(|_| {
                            bad("DOWN/EVERY such as 10s/60s (down shorter than every), or off")
                        })?),
                    }
                }
                "reorder" => {
                    spec.reorder = match value {
                        "on" | "yes" | "true" => true,
                        "off" | "no" | "false" => false,
                        _ => return Err(bad("on or off")),
                    }
                }
                "queue" => {
                    spec.queue.packets = value
                        .parse()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| bad("the delay line's bound in packets, such as 4096"))?
                }
                _ => {
                    return Err(SpecError::UnknownKey {
                        key: key.to_string(),
                    });
                }
            }
            seen.push(key);
        }
        spec.check()?;
        Ok(spec)
    }
}

fn parse_delay(value: &str) -> Option<Duration> {
    let d = match value {
        "0" => Duration::ZERO,
        v => humantime::parse_duration(v).ok()?,
    };
    (d <= MAX_DELAY).then_some(d)
}

impl Loss {
    /// `tenths` tenths of a percent: `Loss::percent_tenths(5)` is 0.5 %.
    pub const fn percent_tenths(tenths: u32) -> Loss {
        Loss {
            per_million: tenths * 1_000,
        }
    }

    pub fn fraction(self) -> f64 {
        f64::from(self.per_million) / f64::from(LOSS_SCALE)
    }

    pub fn is_zero(self) -> bool {
        self.per_million == 0
    }
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Percent with up to four decimals (one part per million), trailing zeros dropped.
        let whole = self.per_million / 10_000;
        let frac = self.per_million % 10_000;
        if frac == 0 {
            write!(f, "{whole}%")
        } else {
            let digits = format!("{frac:04}");
            write!(f, "{whole}.{}%", digits.trim_end_matches('0'))
        }
    }
}

impl FromStr for Loss {
    type Err = ();

    /// `N%` or `N.NNNN%` (to one part per million), or `0`.
    fn from_str(s: &str) -> Result<Self, ()> {
        if s == "0" {
            return Ok(Loss::default());
        }
        let number = s.strip_suffix('%').ok_or(())?;
        let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty()
            || frac.len() > 4
            || !(whole.bytes().chain(frac.bytes())).all(|b| b.is_ascii_digit())
        {
            return Err(());
        }
        let whole: u32 = whole.parse().map_err(|_| ())?;
        let frac: u32 = format!("{frac:0<4}").parse().map_err(|_| ())?;
        let per_million = whole
            .checked_mul(10_000)
            .and_then(|w| w.checked_add(frac))
            .ok_or(())?;
        (per_million <= LOSS_SCALE)
            .then_some(Loss { per_million })
            .ok_or(())
    }
}

impl Rate {
    pub const fn mbit(n: u64) -> Rate {
        Rate {
            bits_per_second: n * 1_000_000,
        }
    }

    pub fn bytes_per_second(self) -> f64 {
        self.bits_per_second as f64 / 8.0
    }
}

impl fmt::Display for Rate {
    /// In tc's units, the largest that divides it exactly.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.bits_per_second;
        for (unit, scale) in [
            ("gbit", 1_000_000_000),
            ("mbit", 1_000_000),
            ("kbit", 1_000),
        ] {
            if b.is_multiple_of(scale) {
                return write!(f, "{}{unit}", b / scale);
            }
        }
        write!(f, "{b}bit")
    }
}

impl FromStr for Rate {
    type Err = ();

    /// `20mbit`, `1.5mbit`, `500kbit`, `1gbit`, `64000bit` (tc's units, powers of ten).
    fn from_str(s: &str) -> Result<Self, ()> {
        let s = s.to_ascii_lowercase();
        let (number, scale) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
            .into_iter()
            .find_map(|(unit, scale)| s.strip_suffix(unit).map(|n| (n.to_string(), scale)))
            .ok_or(())?;
        let n: f64 = number.parse().map_err(|_| ())?;
        let bits = n * scale;
        // Below 8 kbit/s not one full-size packet a second gets through.
        if !bits.is_finite() || !(8_000.0..=100e9).contains(&bits) {
            return Err(());
        }
        Ok(Rate {
            bits_per_second: bits.round() as u64,
        })
    }
}

impl fmt::Display for Flap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            humantime::format_duration(self.down),
            humantime::format_duration(self.every)
        )
    }
}

impl FromStr for Flap {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        let (down, every) = s.split_once('/').ok_or(())?;
        let down = humantime::parse_duration(down.trim()).map_err(|_| ())?;
        let every = humantime::parse_duration(every.trim()).map_err(|_| ())?;
        (!down.is_zero() && down < every)
            .then_some(Flap { down, every })
            .ok_or(())
    }
}

impl Flap {
    /// Whether the link is down `elapsed` after it was made: each period is up first, then
    /// down for its last `down`.
    pub fn is_down(&self, elapsed: Duration) -> bool {
        let into = elapsed.as_nanos() % self.every.as_nanos();
        into >= (self.every - self.down).as_nanos()
    }

    /// How long after `elapsed` the link next changes state (goes down or comes back).
    pub fn next_change(&self, elapsed: Duration) -> Duration {
        let every = self.every.as_nanos();
        let into = elapsed.as_nanos() % every;
        let up_for = (self.every - self.down).as_nanos();
        let left = if into < up_for {
            up_for - into
        } else {
            every - into
        };
        Duration::from_nanos(left as u64)
    }
}

/// Why a link spec was refused. None is retryable: the spec must change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// Nothing was given. Not retryable: give a profile or keys.
    #[error(
        "the link spec is empty; give a profile ({}) or keys ({KEYS})",
        profile_names()
    )]
    Empty,
    /// The first item names no profile. Not retryable: use one of the names listed.
    #[error("unknown link profile `{name}`; the profiles are {}", profile_names())]
    UnknownProfile { name: String },
    /// A key the spec does not have. Not retryable: use one of the keys listed.
    #[error(
        "unknown key `{key}` in the link spec; the keys are {KEYS} (a profile name may come first)"
    )]
    UnknownKey { key: String },
    /// A key given twice. Not retryable: give it once.
    #[error("`{key}` is given twice in the link spec; give it once")]
    Repeated { key: String },
    /// A value of the wrong form. Not retryable: the message says the accepted forms.
    #[error("`{key}={value}` in the link spec: expected {expected}")]
    BadValue {
        key: String,
        value: String,
        expected: &'static str,
    },
    /// Jitter larger than the delay would ask for negative holds. Not retryable: lower the
    /// jitter or raise the delay.
    #[error(
        "jitter={} is more than delay={} in the link spec: a round trip cannot be shorter than no delay; lower the jitter or raise the delay",
        humantime::format_duration(*jitter),
        humantime::format_duration(*delay)
    )]
    JitterAboveDelay { jitter: Duration, delay: Duration },
}

fn profile_names() -> String {
    Profile::ALL.map(Profile::name).join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_issue_example_parses_to_the_lte_flapping_link() {
        let spec: LinkSpec = "delay=80ms,jitter=20ms,loss=0.5%,rate=20mbit,flap=10s/60s"
            .parse()
            .unwrap();
        assert_eq!(spec, Profile::Flapping.spec());
        assert_eq!(spec.one_way_delay(), ms(40));
        assert_eq!(spec.one_way_jitter(), ms(10));
        assert_eq!(spec.min_round_trip(), ms(60));
    }

    #[test]
    fn profiles_are_the_issue_figures() {
        let check = |p: Profile, delay, jitter, loss_ppm, mbit: Option<u64>| {
            let s = p.spec();
            assert_eq!(
                (s.delay, s.jitter, s.loss.per_million, s.rate),
                (ms(delay), ms(jitter), loss_ppm, mbit.map(Rate::mbit)),
                "{p}"
            );
            assert_eq!(p.name().parse::<Profile>().unwrap(), p);
            // Every profile written out parses back to itself.
            assert_eq!(s.to_string().parse::<LinkSpec>().unwrap(), s, "{p}: {s}");
        };
        check(Profile::Lan, 1, 0, 0, None);
        check(Profile::Lte, 80, 20, 5_000, Some(20));
        check(Profile::Congested, 300, 100, 30_000, Some(2));
        check(Profile::Satellite, 650, 0, 10_000, Some(5));
        check(Profile::Flapping, 80, 20, 5_000, Some(20));
        assert_eq!(
            Profile::Flapping.spec().flap,
            Some(Flap {
                down: Duration::from_secs(10),
                every: Duration::from_secs(60)
            })
        );
        assert!(
            Profile::ALL
                .iter()
                .all(|p| p.spec().flap.is_none() == (*p != Profile::Flapping))
        );
    }

    #[test]
    fn a_profile_first_takes_the_keys_after_it_as_changes() {
        let spec: LinkSpec = "congested, loss=10%, reorder".parse().unwrap();
        assert_eq!(spec.delay, ms(300));
        assert_eq!(spec.loss.per_million, 100_000);
        assert!(spec.reorder);
        let plain: LinkSpec = "delay=10ms".parse().unwrap();
        assert_eq!(plain.rate, None);
        assert!(plain.loss.is_zero());
    }

    #[test]
    fn values_parse_in_their_accepted_forms() {
        let loss = |s: &str| s.parse::<Loss>().map(|l| l.per_million);
        assert_eq!(loss("0.5%"), Ok(5_000));
        assert_eq!(loss("3%"), Ok(30_000));
        assert_eq!(loss("0"), Ok(0));
        assert_eq!(loss("100%"), Ok(1_000_000));
        assert_eq!(loss("0.0001%"), Ok(1));
        for bad in ["101%", "0.5", "-1%", "%", "0.00001%", "1e2%", "0.5 %"] {
            assert_eq!(loss(bad), Err(()), "{bad}");
        }
        let rate = |s: &str| s.parse::<Rate>().map(|r| r.bits_per_second);
        assert_eq!(rate("20mbit"), Ok(20_000_000));
        assert_eq!(rate("1.5Mbit"), Ok(1_500_000));
        assert_eq!(rate("500kbit"), Ok(500_000));
        assert_eq!(rate("1gbit"), Ok(1_000_000_000));
        for bad in ["20", "20mb", "0mbit", "1bit", "fastmbit"] {
            assert_eq!(rate(bad), Err(()), "{bad}");
        }
        assert_eq!(Rate::mbit(2).to_string(), "2mbit");
        assert_eq!(
            Rate {
                bits_per_second: 1_500_000
            }
            .to_string(),
            "1500kbit"
        );
        assert_eq!(Loss::percent_tenths(5).to_string(), "0.5%");
        assert_eq!(Loss { per_million: 1 }.to_string(), "0.0001%");
        assert!("10s/10s".parse::<Flap>().is_err());
        assert!("0s/10s".parse::<Flap>().is_err());
        assert!("10s".parse::<Flap>().is_err());
    }

    #[test]
    fn bad_specs_name_the_key_or_value_and_the_accepted_forms() {
        let check = |spec: &str, says: &[&str]| {
            let e = spec.parse::<LinkSpec>().unwrap_err().to_string();
            for s in says {
                assert!(e.contains(s), "{spec}: {e} should say {s}");
            }
        };
        check("", &["empty", "lte", "delay"]);
        check(
            "wifi",
            &["`wifi`", "lan, lte, congested, satellite, flapping"],
        );
        check(
            "delay=80ms,latency=3ms",
            &["`latency`", "delay, jitter, loss"],
        );
        check("delay=80", &["`delay=80`", "80ms"]);
        check("delay=11s", &["`delay=11s`", "up to 10s"]);
        check("loss=0.5", &["`loss=0.5`", "0.5%"]);
        check("rate=20mb", &["`rate=20mb`", "20mbit"]);
        check("flap=60s/10s", &["`flap=60s/10s`", "10s/60s"]);
        check("reorder=maybe", &["`reorder=maybe`", "on or off"]);
        check("queue=0", &["`queue=0`", "packets"]);
        check("delay=1ms,delay=2ms", &["`delay`", "twice"]);
        check("delay=10ms,jitter=30ms", &["jitter=30ms", "delay=10ms"]);
    }

    #[test]
    fn a_flap_is_up_first_then_down_for_the_end_of_each_period() {
        let flap = Flap {
            down: Duration::from_secs(10),
            every: Duration::from_secs(60),
        };
        let s = Duration::from_secs;
        for (at, down, next) in [
            (0, false, 50),
            (49, false, 1),
            (50, true, 10),
            (59, true, 1),
            (60, false, 50),
            (115, true, 5),
        ] {
            assert_eq!(flap.is_down(s(at)), down, "at {at}s");
            assert_eq!(flap.next_change(s(at)), s(next), "at {at}s");
        }
    }
}
