//! SVG plots of a report: the reconnect curve (sessions over time, the hub's stop marked), the
//! fan-out latency CDF, and the hub's RSS against sessions.

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

use crate::report::{Report, ScenarioReport};

const SIZE: (u32, u32) = (900, 520);

/// Writes every plot the report has data for into `dir`; returns the file names.
pub fn write_all(report: &Report, dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut written = Vec::new();
    for s in &report.scenarios {
        match s.name.as_str() {
            "storm" | "outage" if !s.curve.is_empty() => {
                let file = format!("{}-reconnect.svg", s.name);
                reconnect_curve(s, &dir.join(&file))?;
                written.push(file);
            }
            "connect" if !s.curve.is_empty() => {
                let file = "connect-ramp.svg".to_string();
                reconnect_curve(s, &dir.join(&file))?;
                written.push(file);
                if s.rss_curve.len() >= 2 {
                    let file = "rss-vs-sessions.svg".to_string();
                    rss_curve(s, &dir.join(&file))?;
                    written.push(file);
                }
            }
            "fanout" if s.ack_latency.as_ref().is_some_and(|p| p.count > 0) => {
                let file = "fanout-cdf.svg".to_string();
                fanout_cdf(s, &dir.join(&file))?;
                written.push(file);
            }
            _ => {}
        }
    }
    Ok(written)
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing a plot: {e:?}")
}

fn reconnect_curve(s: &ScenarioReport, path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let t_max = s.curve.last().map_or(1.0, |p| p.t_s).max(0.1);
    let y_max = (s.agents as f64).max(1.0) * 1.05;
    let title = match s.name.as_str() {
        "connect" => format!("connect: sessions during the ramp ({} agents)", s.agents),
        name => format!(
            "{name}: sessions connected, hub stopped with {} ({} agents)",
            s.signal.as_deref().unwrap_or("?"),
            s.agents
        ),
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..t_max, 0.0..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("seconds since the scenario started")
        .y_desc("sessions connected")
        .draw()
        .map_err(err)?;
    chart
        .draw_series(LineSeries::new(
            s.curve.iter().map(|p| (p.t_s, p.value)),
            BLUE.stroke_width(2),
        ))
        .map_err(err)?
        .label("sessions connected")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    for (at, label, color) in [
        (s.hub_stopped_at_s, "hub stopped", RED),
        (s.hub_started_at_s, "hub started again", GREEN),
    ] {
        if let Some(at) = at {
            chart
                .draw_series(LineSeries::new(
                    vec![(at, 0.0), (at, y_max)],
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

fn fanout_cdf(s: &ScenarioReport, path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    /// (label, CDF points, colour).
    type Series<'a> = (&'a str, &'a Vec<(f64, f64)>, RGBColor);
    let series: Vec<Series> = [
        (
            "create → durable ack on the agent",
            s.ack_latency.as_ref(),
            BLUE,
        ),
        (
            "create → Applied on the hub",
            s.applied_latency.as_ref(),
            RED,
        ),
    ]
    .into_iter()
    .filter_map(|(l, p, c)| p.filter(|p| p.count > 0).map(|p| (l, &p.cdf, c)))
    .collect();
    let x_max = series
        .iter()
        .flat_map(|(_, cdf, _)| cdf.iter().map(|(ms, _)| *ms))
        .fold(1.0f64, f64::max)
        * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "fanout: one ManifestWork to {} agents, latency CDF",
                s.agents
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("milliseconds since the work was created")
        .y_desc("fraction of agents")
        .draw()
        .map_err(err)?;
    for (label, cdf, color) in series {
        chart
            .draw_series(LineSeries::new(cdf.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

fn rss_curve(s: &ScenarioReport, path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let x_max = s
        .rss_curve
        .iter()
        .map(|(n, _)| *n)
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.05;
    let y_max = s.rss_curve.iter().map(|(_, r)| mib(*r)).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "hub RSS against sessions ({:.1} KiB per session)",
                s.hub_rss_per_session_bytes.unwrap_or(0.0) / 1024.0
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("sessions connected")
        .y_desc("hub RSS (MiB)")
        .draw()
        .map_err(err)?;
    chart
        .draw_series(
            s.rss_curve
                .iter()
                .map(|(n, r)| Circle::new((*n as f64, mib(*r)), 2, BLUE.filled())),
        )
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
