//! The report: a versioned JSON document (`"schema": "flotilla-loadtest/v1"`), a table for
//! people, and the numbers plots are drawn from.
//!
//! Schema v1, top level: `schema`, `tool_version`, `started_at`/`finished_at` (RFC 3339),
//! `command` (argv), `parameters` (every flag, defaults included), `machine` (cores, memory,
//! kernel, open-file limits, load), `hub` (mode and addresses), `scenarios` (one object per
//! scenario run, in order, with `name`, `outcome` and the scenario's own fields, all optional so
//! a scenario that stopped early still reports what it saw), and `plots` (file names written).
//! Durations are seconds (`_s`) or milliseconds (`_ms`), sizes bytes (`_bytes`). Fields are only
//! ever added within v1.

use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::cli::RunArgs;
use crate::machine::Machine;

/// The schema identifier every report carries.
pub const SCHEMA: &str = "flotilla-loadtest/v1";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub tool_version: String,
    pub started_at: String,
    pub finished_at: String,
    pub command: Vec<String>,
    pub parameters: RunArgs,
    pub machine: Machine,
    pub hub: HubInfo,
    pub scenarios: Vec<ScenarioReport>,
    pub plots: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HubInfo {
    /// `child`, `in-process` or `external`.
    pub mode: String,
    pub agents_address: String,
    pub api_address: String,
}

/// How a scenario ended.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Everything it waited for happened.
    Completed,
    /// `--timeout` expired first; the numbers are what it saw until then.
    TimedOut,
    /// It could not run; `error` says why.
    Failed,
}

/// One point of a curve: seconds since the scenario started, and a value.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct Point {
    pub t_s: f64,
    pub value: f64,
}

/// Percentiles of a latency distribution, in milliseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub count: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// (latency ms, fraction of samples at or below it), for the CDF plot.
    pub cdf: Vec<(f64, f64)>,
}

impl Percentiles {
    /// From latencies in microseconds.
    pub fn from_micros(samples: &[u64]) -> Percentiles {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)
            .expect("static histogram bounds are valid");
        for s in samples {
            let _ = h.record((*s).clamp(1, 3_600_000_000));
        }
        if h.is_empty() {
            return Percentiles::default();
        }
        let ms = |v: u64| v as f64 / 1000.0;
        let cdf = (0..=100)
            .map(|q| {
                let q = q as f64 / 100.0;
                (ms(h.value_at_quantile(q)), q)
            })
            .collect();
        Percentiles {
            count: h.len(),
            p50_ms: ms(h.value_at_quantile(0.50)),
            p90_ms: ms(h.value_at_quantile(0.90)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
            cdf,
        }
    }

    pub fn ordered(&self) -> bool {
        self.p50_ms <= self.p90_ms && self.p90_ms <= self.p99_ms && self.p99_ms <= self.max_ms
    }
}

/// Statuses compared between the agents and the hub.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StatusAudit {
    /// Agents whose records were read.
    pub agents: u64,
    /// (agent, work) pairs compared.
    pub compared: u64,
    /// The agent's latest status is not what the hub stored (or the hub has none).
    pub lost: u64,
    /// A status seq the hub acknowledged more than once to the same agent.
    pub duplicated: u64,
    /// Statuses still waiting in agents' outboxes when the audit ran.
    pub unacked: u64,
    /// Works an agent holds but has produced no status for yet (still applying).
    pub without_status: u64,
    /// A few mismatches, for a person to look at.
    pub examples: Vec<String>,
}

/// One scenario's results. Which fields are set depends on the scenario.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ScenarioReport {
    pub name: String,
    pub outcome: Option<Outcome>,
    pub error: Option<String>,
    pub duration_s: f64,
    /// Agents that took part.
    pub agents: u64,

    // connect
    /// With `--enroll join`: agents that joined with the bootstrap token, and that gave up.
    pub joined: Option<u64>,
    pub join_failures: Option<u64>,
    pub connected: Option<u64>,
    pub available_on_hub: Option<u64>,
    pub time_to_all_connected_s: Option<f64>,
    pub time_to_all_available_s: Option<f64>,
    pub handshakes_per_s: Option<f64>,
    pub peak_handshakes_per_s: Option<f64>,
    pub failed_attempts: Option<u64>,
    pub hub_rss_before_bytes: Option<u64>,
    pub hub_rss_after_bytes: Option<u64>,
    pub hub_rss_per_session_bytes: Option<f64>,
    pub hub_cpu_s: Option<f64>,
    pub harness_cpu_s: Option<f64>,
    /// Hub RSS (bytes) against sessions connected, sampled during the ramp.
    pub rss_curve: Vec<(u64, u64)>,

    // fanout
    pub work: Option<String>,
    pub create_s: Option<f64>,
    pub acked: Option<u64>,
    pub applied_on_hub: Option<u64>,
    pub ack_latency: Option<Percentiles>,
    pub applied_latency: Option<Percentiles>,
    pub poll_interval_ms: Option<f64>,

    // storm and outage
    pub signal: Option<String>,
    pub sessions_before: Option<u64>,
    pub hub_down_s: Option<f64>,
    pub time_to_all_back_s: Option<f64>,
    pub peak_accept_per_s: Option<f64>,
    pub resume_frames_in: Option<u64>,
    pub resume_bytes_in: Option<u64>,
    pub resume_frames_out: Option<u64>,
    pub resume_bytes_out: Option<u64>,
    pub convergence_s: Option<f64>,
    pub statuses: Option<StatusAudit>,

    /// Sessions connected over time (every 100 ms), for connect, storm and outage.
    pub curve: Vec<Point>,
    /// Seconds into the scenario when the hub was stopped and started again.
    pub hub_stopped_at_s: Option<f64>,
    pub hub_started_at_s: Option<f64>,
}

impl ScenarioReport {
    pub fn new(name: &str, agents: usize) -> ScenarioReport {
        ScenarioReport {
            name: name.to_string(),
            agents: agents as u64,
            ..Default::default()
        }
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn secs(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2} s"))
}

/// The table printed at the end of a run.
pub fn table(report: &Report) -> String {
    let mut t = String::new();
    let m = &report.machine;
    let _ = writeln!(
        t,
        "flotilla-loadtest: {} agents, hub {} at {}, {} cores, {:.1} GiB, kernel {}, load {:.2}",
        report.parameters.agents,
        report.hub.mode,
        report.hub.agents_address,
        m.cores,
        m.memory_bytes as f64 / (1u64 << 30) as f64,
        m.kernel,
        m.load_average_1m
    );
    for s in &report.scenarios {
        let outcome = match s.outcome {
            Some(Outcome::Completed) => "completed".to_string(),
            Some(Outcome::TimedOut) => "TIMED OUT".to_string(),
            Some(Outcome::Failed) | None => {
                format!("FAILED: {}", s.error.as_deref().unwrap_or("?"))
            }
        };
        let _ = writeln!(t, "\n{:<10} {} in {:.1} s", s.name, outcome, s.duration_s);
        let mut row = |k: &str, v: String| {
            let _ = writeln!(t, "  {k:<34} {v}");
        };
        match s.name.as_str() {
            "connect" => {
                if let Some(joined) = s.joined {
                    row(
                        "joined (token, CSR, auto-accept)",
                        format!("{joined} / {} ({} gave up)", s.agents, opt(s.join_failures)),
                    );
                }
                row(
                    "sessions connected",
                    format!("{} / {}", opt(s.connected), s.agents),
                );
                row(
                    "Available on the hub",
                    format!("{} / {}", opt(s.available_on_hub), s.agents),
                );
                row("time to all connected", secs(s.time_to_all_connected_s));
                row("time to all Available", secs(s.time_to_all_available_s));
                row(
                    "handshakes/s (mean, peak)",
                    format!(
                        "{:.0}, {:.0}",
                        s.handshakes_per_s.unwrap_or(0.0),
                        s.peak_handshakes_per_s.unwrap_or(0.0)
                    ),
                );
                row("failed attempts", opt(s.failed_attempts));
                row(
                    "hub RSS before → after",
                    match (s.hub_rss_before_bytes, s.hub_rss_after_bytes) {
                        (Some(b), Some(a)) => format!("{:.1} → {:.1} MiB", mib(b), mib(a)),
                        _ => "- (hub not a child process)".into(),
                    },
                );
                row(
                    "hub RSS per session",
                    s.hub_rss_per_session_bytes
                        .map_or("-".into(), |b| format!("{:.1} KiB", b / 1024.0)),
                );
                row("hub CPU", secs(s.hub_cpu_s));
                row("harness CPU", secs(s.harness_cpu_s));
            }
            "fanout" => {
                row("ManifestWork", opt(s.work.clone()));
                row("created in", secs(s.create_s));
                row(
                    "acked by agents",
                    format!("{} / {}", opt(s.acked), s.agents),
                );
                row(
                    "Applied on the hub",
                    format!("{} / {}", opt(s.applied_on_hub), s.agents),
                );
                if let Some(p) = &s.ack_latency {
                    row("create → durable ack", pct(p));
                }
                if let Some(p) = &s.applied_latency {
                    row(
                        &format!(
                            "create → Applied (±{:.0} ms)",
                            s.poll_interval_ms.unwrap_or(0.0)
                        ),
                        pct(p),
                    );
                }
            }
            _ => {
                row("hub stopped with", opt(s.signal.clone()));
                row("sessions before", opt(s.sessions_before));
                row("hub down for", secs(s.hub_down_s));
                row("time to 100% back", secs(s.time_to_all_back_s));
                row(
                    "peak accept rate",
                    s.peak_accept_per_s
                        .map_or("-".into(), |v| format!("{v:.0} sessions/s")),
                );
                if s.resume_frames_in.is_some() {
                    row(
                        "resume volume hub→agents",
                        format!(
                            "{} frames, {} bytes",
                            opt(s.resume_frames_in),
                            opt(s.resume_bytes_in)
                        ),
                    );
                    row(
                        "resume volume agents→hub",
                        format!(
                            "{} frames, {} bytes",
                            opt(s.resume_frames_out),
                            opt(s.resume_bytes_out)
                        ),
                    );
                    row("convergence", secs(s.convergence_s));
                }
                if let Some(a) = &s.statuses {
                    row(
                        "statuses lost / duplicated",
                        format!("{} / {} (of {} compared)", a.lost, a.duplicated, a.compared),
                    );
                }
            }
        }
    }
    if !report.plots.is_empty() {
        let _ = writeln!(t, "\nplots: {}", report.plots.join(", "));
    }
    t
}

fn pct(p: &Percentiles) -> String {
    format!(
        "p50 {:.0} ms, p90 {:.0} ms, p99 {:.0} ms, max {:.0} ms (n={})",
        p.p50_ms, p.p90_ms, p.p99_ms, p.max_ms, p.count
    )
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_ordered_and_in_milliseconds() {
        let samples: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let p = Percentiles::from_micros(&samples);
        assert_eq!(p.count, 1000);
        assert!(p.ordered(), "{p:?}");
        assert!((p.p50_ms - 500.0).abs() < 5.0, "{p:?}");
        assert!((p.max_ms - 1000.0).abs() < 5.0, "{p:?}");
        assert_eq!(p.cdf.len(), 101);
        assert_eq!(Percentiles::from_micros(&[]), Percentiles::default());
    }
}
