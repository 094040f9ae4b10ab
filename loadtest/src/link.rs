//! `--link PROFILE` / `--link-spec SPEC`: the run's agents behind emulated wide-area links
//! (`flotilla_wan`): each worker process in a network namespace of its own whose one way out
//! is a link of that spec, so every session, status and tunnel crosses it. And `link-check`,
//! which makes one link and measures it (a ping-like UDP probe, a bulk TCP transfer) next to
//! what was asked.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use clap::builder::{PossibleValue, PossibleValuesParser};
use flotilla_wan::probe::{Bulk, RoundTrips, bulk_transfer, round_trips};
use flotilla_wan::{EmulatedLink, LinkSpec, Profile};
use serde::{Deserialize, Serialize};

/// The probes `link-check` sends when the link does not flap.
pub const DEFAULT_PROBES: usize = 300;
/// The time between probes.
pub const DEFAULT_PROBE_INTERVAL: &str = "20ms";
/// How long the bulk transfer is measured, after [`BULK_WARMUP`].
pub const DEFAULT_BULK_WINDOW: &str = "5s";
/// TCP's slow start, left out of the bulk transfer's figure: at least this, and at least
/// [`BULK_WARMUP_ROUND_TRIPS`] round trips of the link.
const BULK_WARMUP: Duration = Duration::from_secs(1);
const BULK_WARMUP_ROUND_TRIPS: u32 = 10;

/// Where the agents' packets go.
#[derive(Clone, Debug, Default, Args, Serialize, Deserialize)]
pub struct LinkArgs {
    /// Put the agents behind an emulated link of this profile (delay, jitter and loss as real
    /// edge links have them): each worker process (--processes; at least one is used) runs in
    /// a network namespace of its own whose one way out is the link, and reaches the hub
    /// through it. Needs root, iproute2, nftables and /dev/net/tun. Delay and jitter are round
    /// trips; loss and rate apply to each direction.
    #[arg(long, value_parser = profile_names(), conflicts_with = "link_spec")]
    #[serde(default)]
    pub link: Option<String>,

    /// The link as a spec instead of a profile: `delay=80ms,jitter=20ms,loss=0.5%,rate=20mbit,
    /// flap=10s/60s` (round-trip delay and jitter; loss and rate each way; down 10 s every
    /// 60 s), optionally `reorder=on` and `queue=PACKETS` (the delay line's bound), or a
    /// profile first with changes after it: `congested,loss=10%`.
    #[arg(long, value_parser = spec_text)]
    #[serde(default)]
    pub link_spec: Option<String>,
}

impl LinkArgs {
    /// The link asked for, if any (already checked by the flags' parsers).
    pub fn spec(&self) -> anyhow::Result<Option<LinkSpec>> {
        let text = self.link.as_ref().or(self.link_spec.as_ref());
        text.map(|t| t.parse::<LinkSpec>().map_err(anyhow::Error::from))
            .transpose()
    }

    /// How the link was asked for, for the report and the output: the profile's name or the
    /// spec, then the spec in full.
    pub fn describe(&self) -> Option<String> {
        let spec = self.spec().ok()??;
        Some(match &self.link {
            Some(profile) => format!("{profile} ({spec})"),
            None => spec.to_string(),
        })
    }
}

fn profile_names() -> PossibleValuesParser {
    PossibleValuesParser::new(Profile::ALL.map(|p| PossibleValue::new(p.name()).help(p.about())))
}

fn spec_text(text: &str) -> Result<String, String> {
    text.parse::<LinkSpec>()
        .map(|_| text.to_string())
        .map_err(|e| e.to_string())
}

/// A loopback address of the hub or a gateway as the agents behind `link` dial it: the link's
/// host end, same port, which the link sends on to loopback.
pub fn through(link: &EmulatedLink, addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    anyhow::ensure!(
        addr.ip().is_loopback(),
        "--link reaches this machine's loopback services only, and {addr} is not on loopback"
    );
    Ok(SocketAddr::new(IpAddr::V4(link.host()), addr.port()))
}

/// `link-check`: makes one link and measures it.
#[derive(Debug, Args)]
pub struct LinkCheckArgs {
    #[command(flatten)]
    pub link: LinkArgs,

    /// Round-trip probes to send (default: 300, or on a flapping link enough to span one
    /// whole period and the outage after it).
    #[arg(long)]
    pub probes: Option<usize>,

    /// Time between probes.
    #[arg(long, default_value = DEFAULT_PROBE_INTERVAL, value_parser = humantime::parse_duration)]
    pub interval: Duration,

    /// How long the bulk TCP transfer is measured (after TCP's slow start: 1 s or 10 round
    /// trips, whichever is longer).
    #[arg(long, default_value = DEFAULT_BULK_WINDOW, value_parser = humantime::parse_duration)]
    pub bulk: Duration,

    /// Seed of the delay lines' jitter.
    #[arg(long, default_value_t = 28)]
    pub seed: u64,
}

/// What `link-check` measured.
#[derive(Debug)]
pub struct LinkCheck {
    pub asked: String,
    pub spec: LinkSpec,
    pub bulk: Bulk,
    pub probes: RoundTrips,
    /// Packets the delay lines dropped because they were full: in, out.
    pub full_drops: (u64, u64),
    pub host: Ipv4Addr,
    pub inside: Ipv4Addr,
}

/// Makes the link, runs the bulk transfer first (a flapping link is up for its first
/// `every - down`), then the probes, and removes the link.
pub async fn check(args: &LinkCheckArgs) -> anyhow::Result<LinkCheck> {
    let spec = args
        .link
        .spec()?
        .context("link-check measures a link: give --link PROFILE or --link-spec SPEC")?;
    let asked = args.link.describe().unwrap_or_else(|| spec.to_string());
    anyhow::ensure!(
        !args.interval.is_zero(),
        "--interval must be more than zero"
    );
    let probes = args.probes.unwrap_or_else(|| match spec.flap {
        Some(flap) => {
            ((flap.every + flap.down).as_secs_f64() / args.interval.as_secs_f64()).ceil() as usize
        }
        None => DEFAULT_PROBES,
    });
    anyhow::ensure!(
        (1..=100_000).contains(&probes),
        "--probes must be from 1 to 100000"
    );
    flotilla_wan::check_available()?;
    let link = EmulatedLink::create(spec.clone(), args.seed)
        .await
        .context("making the link")?;
    let warmup = BULK_WARMUP.max(spec.delay * BULK_WARMUP_ROUND_TRIPS);
    let bulk = bulk_transfer(&link, warmup, args.bulk).await?;
    // Answers may take the longest hold, a full tbf queue and an outage's end.
    let wait = spec.delay
        + spec.jitter
        + Duration::from_secs(2)
        + spec.flap.map_or(Duration::ZERO, |f| f.down);
    let probes = round_trips(&link, probes, args.interval, wait).await?;
    Ok(LinkCheck {
        asked,
        spec,
        bulk,
        probes,
        full_drops: (link.inbound().dropped_full, link.outbound().dropped_full),
        host: link.host(),
        inside: link.inside_address(),
    })
}

/// The measured figures next to the asked ones.
pub fn table(c: &LinkCheck) -> String {
    let s = &c.spec;
    let p = &c.probes;
    let ms = |d: Option<Duration>| {
        d.map_or_else(
            || "-".to_string(),
            |d| format!("{:.1} ms", d.as_secs_f64() * 1e3),
        )
    };
    let rt_loss = 1.0 - s.round_trip_delivery();
    let mut rows: Vec<(String, String, String)> = vec![
        (
            "round trip p50".into(),
            format!("{} ms", s.delay.as_millis()),
            ms(p.quantile(0.5)),
        ),
        (
            "round trip min / p99 / max".into(),
            format!(
                "{} .. {} ms",
                s.min_round_trip().as_millis(),
                (s.delay + s.jitter).as_millis()
            ),
            format!(
                "{} / {} / {}",
                ms(p.rtts.first().copied()),
                ms(p.quantile(0.99)),
                ms(p.rtts.last().copied())
            ),
        ),
        (
            "round trips lost".into(),
            format!("{:.2} % ({} each way)", rt_loss * 100.0, s.loss),
            format!(
                "{:.2} % ({} of {})",
                p.loss() * 100.0,
                p.sent - p.answered(),
                p.sent
            ),
        ),
        (
            "bulk TCP into the namespace".into(),
            match s.rate {
                Some(rate) => format!("{:.1} Mbit/s", rate.bits_per_second as f64 / 1e6),
                None => "unshaped".into(),
            },
            format!(
                "{:.1} Mbit/s ({:.1} from its start)",
                c.bulk.bits_per_second() / 1e6,
                c.bulk.average_bits_per_second() / 1e6
            ),
        ),
    ];
    rows.push((
        "longest outage".into(),
        match s.flap {
            Some(f) => format!(
                "{} every {}",
                humantime::format_duration(f.down),
                humantime::format_duration(f.every)
            ),
            None => "none".into(),
        },
        format!(
            "{:.2} s ({} probes in a row)",
            p.longest_outage().as_secs_f64(),
            p.longest_gap
        ),
    ));
    rows.push((
        "delay line full: dropped".into(),
        format!("bound {} packets", s.queue.packets),
        format!("{} in, {} out", c.full_drops.0, c.full_drops.1),
    ));
    let mut out = format!(
        "link {}\n  host end {}, namespace end {}; {} probes every {}, bulk measured over {:.1} s\n\n",
        c.asked,
        c.host,
        c.inside,
        p.sent,
        humantime::format_duration(p.interval),
        c.bulk.window.as_secs_f64(),
    );
    out.push_str(&format!("{:<30} {:<28} {}\n", "", "asked", "measured"));
    for (what, asked, measured) in rows {
        out.push_str(&format!("{what:<30} {asked:<28} {measured}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        link: LinkArgs,
    }

    #[test]
    fn a_profile_or_a_spec_is_the_link_and_bad_ones_say_why() {
        let spec = |args: &[&str]| {
            Flags::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
                .map(|f| f.link.spec().unwrap())
                .map_err(|e| e.to_string())
        };
        assert_eq!(spec(&[]), Ok(None));
        assert_eq!(
            spec(&["--link", "congested"]),
            Ok(Some(Profile::Congested.spec()))
        );
        assert_eq!(
            spec(&["--link-spec", "lte,flap=10s/60s"]),
            Ok(Some(Profile::Flapping.spec()))
        );
        let e = spec(&["--link", "wifi"]).unwrap_err();
        assert!(e.contains("wifi") && e.contains("congested"), "{e}");
        let e = spec(&["--link-spec", "delay=80"]).unwrap_err();
        assert!(e.contains("`delay=80`") && e.contains("80ms"), "{e}");
        assert!(spec(&["--link", "lte", "--link-spec", "delay=1ms"]).is_err());
    }

    #[test]
    fn the_help_says_what_each_profile_means() {
        let help = Flags::command().render_long_help().to_string();
        for p in Profile::ALL {
            assert!(help.contains(p.name()), "{help}");
            assert!(help.contains(p.about()), "{}: {help}", p.name());
        }
    }
}
