//! Just enough of the Prometheus text exposition formats (0.0.4, and OpenMetrics text, which
//! flotilla's processes write) to read a `/metrics` page: sample lines
//! `name{label="value",...} value [timestamp]`, with `#` lines and blank lines skipped.
//!
//! The kube-apiserver's page is several megabytes of histograms; [`samples`] only builds the
//! samples whose metric name the caller asks for and skips every other line after reading its
//! name. [`check`] reads a whole page strictly, as a scraper that rejects bad pages would: the
//! load test reads the apiserver with the first, flotilla's own tests hold its pages to the
//! second.

use std::collections::BTreeMap;

/// One sample line: a metric name, its labels and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    /// The value of label `key`; an absent label reads as empty, as in PromQL.
    pub fn label(&self, key: &str) -> &str {
        self.labels.get(key).map_or("", String::as_str)
    }
}

/// A line that is neither a comment, blank, nor a well-formed sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub problem: String,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "metrics line {}: {}", self.line, self.problem)
    }
}

impl std::error::Error for ParseError {}

/// Every sample in `text` whose metric name satisfies `wanted`, in page order. A malformed
/// line of a wanted metric is an error; malformed lines of other metrics are not looked at.
pub fn samples(text: &str, wanted: impl Fn(&str) -> bool) -> Result<Vec<Sample>, ParseError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| c == '{' || c.is_whitespace())
            .unwrap_or(line.len());
        let name = &line[..name_end];
        if !wanted(name) {
            continue;
        }
        let at = |problem: String| ParseError {
            line: i + 1,
            problem,
        };
        let mut rest = &line[name_end..];
        let mut labels = BTreeMap::new();
        if let Some(after_brace) = rest.strip_prefix('{') {
            rest = parse_labels(after_brace, &mut labels).map_err(at)?;
        }
        let value_text = rest
            .split_whitespace()
            .next()
            .ok_or_else(|| at(format!("{name} has no value")))?;
        let value = parse_value(value_text)
            .ok_or_else(|| at(format!("{name} has value {value_text:?}, not a number")))?;
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    Ok(out)
}

/// What `# TYPE` says a family is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FamilyType {
    Counter,
    Gauge,
    Histogram,
    Summary,
    Info,
    StateSet,
    Unknown,
}

impl FamilyType {
    fn parse(s: &str) -> Option<FamilyType> {
        Some(match s {
            "counter" => FamilyType::Counter,
            "gauge" => FamilyType::Gauge,
            "histogram" => FamilyType::Histogram,
            "summary" => FamilyType::Summary,
            "info" => FamilyType::Info,
            "stateset" => FamilyType::StateSet,
            "unknown" | "untyped" => FamilyType::Unknown,
            _ => return None,
        })
    }

    /// The suffixes a sample name may add to its family's name.
    fn suffixes(self) -> &'static [&'static str] {
        match self {
            // A bare name is found so that the error can say what is wrong with it.
            FamilyType::Counter => &["_total", "_created", ""],
            FamilyType::Histogram => &["_bucket", "_sum", "_count", "_created"],
            FamilyType::Summary => &["", "_sum", "_count", "_created"],
            FamilyType::Info => &["_info"],
            _ => &[""],
        }
    }
}

/// A metric family: its `# HELP` and `# TYPE` and its samples.
#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    pub name: String,
    pub help: String,
    pub kind: FamilyType,
    pub samples: Vec<Sample>,
}

/// A whole page, read by [`check`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Exposition {
    pub families: Vec<Family>,
}

impl Exposition {
    /// The family called `name`.
    pub fn family(&self, name: &str) -> Option<&Family> {
        self.families.iter().find(|f| f.name == name)
    }

    /// The value of sample `name` whose labels include every `labels` pair; `None` when there is
    /// no such sample.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.families
            .iter()
            .flat_map(|f| &f.samples)
            .find(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == *v))
            .map(|s| s.value)
    }
}

fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Reads a whole page strictly: every sample belongs to a family declared before it with both
/// `# HELP` and `# TYPE`; metric and label names are Prometheus names; a counter's samples end
/// in `_total`; no series appears twice; a histogram's buckets are cumulative, end with
/// `le="+Inf"`, and that bucket equals its `_count`; `# EOF`, when present, is the last line.
pub fn check(text: &str) -> Result<Exposition, ParseError> {
    let mut page = Exposition::default();
    let mut helps: BTreeMap<String, String> = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    let mut eof = false;
    for (i, raw) in text.lines().enumerate() {
        let at = |problem: String| ParseError {
            line: i + 1,
            problem,
        };
        let line = raw.trim_end();
        if eof {
            return Err(at("a line after # EOF".into()));
        }
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let mut words = comment.trim_start().splitn(3, ' ');
            match (words.next(), words.next(), words.next()) {
                (Some("EOF"), None, None) => eof = true,
                (Some("HELP"), Some(name), help) => {
                    if !is_metric_name(name) {
                        return Err(at(format!("HELP of {name:?}, not a metric name")));
                    }
                    helps.insert(name.to_string(), help.unwrap_or("").to_string());
                }
                (Some("TYPE"), Some(name), Some(kind)) => {
                    if !is_metric_name(name) {
                        return Err(at(format!("TYPE of {name:?}, not a metric name")));
                    }
                    let kind = FamilyType::parse(kind.trim())
                        .ok_or_else(|| at(format!("{name} has type {kind:?}")))?;
                    if page.family(name).is_some() {
                        return Err(at(format!("{name} is declared twice")));
                    }
                    let help = helps
                        .get(name)
                        .cloned()
                        .ok_or_else(|| at(format!("{name} has a TYPE but no HELP before it")))?;
                    page.families.push(Family {
                        name: name.to_string(),
                        help,
                        kind,
                        samples: Vec::new(),
                    });
                }
                _ => {}
            }
            continue;
        }
        let sample = samples(line, |_| true)
            .map_err(|e| at(e.problem))?
            .pop()
            .ok_or_else(|| at("not a sample".into()))?;
        if !is_metric_name(&sample.name) {
            return Err(at(format!("{:?} is not a metric name", sample.name)));
        }
        if let Some(bad) = sample.labels.keys().find(|k| !is_label_name(k)) {
            return Err(at(format!(
                "{} has label {bad:?}, not a label name",
                sample.name
            )));
        }
        let family = page
            .families
            .iter_mut()
            .rev()
            .find(|f| {
                f.kind
                    .suffixes()
                    .iter()
                    .any(|s| sample.name.strip_suffix(s) == Some(f.name.as_str()))
            })
            .ok_or_else(|| {
                at(format!(
                    "{} has no family declared before it (HELP and TYPE, with the suffix its type allows)",
                    sample.name
                ))
            })?;
        if family.kind == FamilyType::Counter
            && !sample.name.ends_with("_total")
            && !sample.name.ends_with("_created")
        {
            return Err(at(format!(
                "counter sample {} does not end in _total",
                sample.name
            )));
        }
        if !seen.insert((sample.name.clone(), format!("{:?}", sample.labels))) {
            return Err(at(format!(
                "{} {:?} appears twice",
                sample.name, sample.labels
            )));
        }
        family.samples.push(sample);
    }
    for family in &page.families {
        if family.kind == FamilyType::Histogram {
            check_histogram(family)?;
        }
    }
    Ok(page)
}

/// Buckets cumulative in `le` order, ending at `+Inf` equal to `_count`, for every series.
fn check_histogram(family: &Family) -> Result<(), ParseError> {
    let problem = |problem: String| ParseError { line: 0, problem };
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let key = |s: &Sample| {
        let mut labels = s.labels.clone();
        labels.remove("le");
        format!("{labels:?}")
    };
    for s in family
        .samples
        .iter()
        .filter(|s| s.name.ends_with("_bucket"))
    {
        let le = parse_value(s.label("le"))
            .ok_or_else(|| problem(format!("{} has a bucket without a numeric le", family.name)))?;
        series.entry(key(s)).or_default().push((le, s.value));
    }
    if series.is_empty() {
        return Err(problem(format!("histogram {} has no buckets", family.name)));
    }
    for (labels, mut buckets) in series {
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        if buckets.windows(2).any(|w| w[1].1 < w[0].1) {
            return Err(problem(format!(
                "histogram {} {labels}: buckets are not cumulative: {buckets:?}",
                family.name
            )));
        }
        let last = buckets.last().expect("not empty");
        if last.0 != f64::INFINITY {
            return Err(problem(format!(
                "histogram {} {labels} has no +Inf bucket",
                family.name
            )));
        }
        let count = family
            .samples
            .iter()
            .find(|s| s.name == format!("{}_count", family.name) && key(s) == labels)
            .ok_or_else(|| problem(format!("histogram {} {labels} has no _count", family.name)))?;
        if count.value != last.1 {
            return Err(problem(format!(
                "histogram {} {labels}: +Inf bucket {} differs from _count {}",
                family.name, last.1, count.value
            )));
        }
    }
    Ok(())
}

/// Parses `key="value",...}` into `labels`; returns what follows the closing brace.
fn parse_labels<'a>(
    mut s: &'a str,
    labels: &mut BTreeMap<String, String>,
) -> Result<&'a str, String> {
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Ok(rest);
        }
        let eq = s
            .find('=')
            .ok_or_else(|| format!("label list {s:?} lacks '='"))?;
        let key = s[..eq].trim();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("label name {key:?} is not a Prometheus label name"));
        }
        s = s[eq + 1..].trim_start();
        let Some(quoted) = s.strip_prefix('"') else {
            return Err(format!("label {key} has an unquoted value"));
        };
        let mut value = String::new();
        let mut chars = quoted.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    Some((_, c)) => {
                        value.push('\\');
                        value.push(c);
                    }
                    None => return Err(format!("label {key}'s value ends in a backslash")),
                },
                Some((_, c)) => value.push(c),
                None => return Err(format!("label {key}'s value is not closed")),
            }
        };
        labels.insert(key.to_string(), value);
        s = quoted[end + 1..].trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err(format!("expected ',' or '}}' after label {key}"));
        }
    }
}

/// A sample value: a float, or `+Inf`, `-Inf`, `NaN` as Prometheus writes them.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as a v1.36 kube-apiserver writes them.
    const PAGE: &str = r#"
# HELP apiserver_request_total [STABLE] Counter of apiserver requests broken out for each verb, dry run value, group, version, resource, scope, component, and HTTP response code.
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="namespaces",scope="resource",subresource="",verb="GET",version="v1"} 12
apiserver_request_total{code="201",component="apiserver",dry_run="",group="work.open-cluster-management.io",resource="manifestworks",scope="resource",subresource="",verb="POST",version="v1"} 1000
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="",scope="",subresource="/metrics",verb="GET",version=""} 3
# HELP apiserver_longrunning_requests [STABLE] Gauge of all active long-running apiserver requests.
# TYPE apiserver_longrunning_requests gauge
apiserver_longrunning_requests{component="apiserver",group="coordination.k8s.io",resource="leases",scope="namespace",subresource="",verb="WATCH",version="v1"} 2
apiserver_request_duration_seconds_bucket{component="apiserver",group="",resource="pods",le="+Inf"} 7
process_start_time_seconds 1.71234567891e+09
"#;

    fn check(text: &str, name: &str, expected: &[(&[(&str, &str)], f64)]) {
        let got = samples(text, |n| n == name).expect("parses");
        let want: Vec<Sample> = expected
            .iter()
            .map(|(labels, value)| Sample {
                name: name.to_string(),
                labels: labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                value: *value,
            })
            .collect();
        assert_eq!(got, want, "{name} in {text:?}");
    }

    #[test]
    fn wanted_samples_are_read_with_their_labels() {
        let requests = samples(PAGE, |n| n == "apiserver_request_total").unwrap();
        assert_eq!(requests.len(), 3);
        assert_eq!(requests[1].label("resource"), "manifestworks");
        assert_eq!(requests[1].label("verb"), "POST");
        assert_eq!(requests[1].value, 1000.0);
        assert_eq!(requests[2].label("subresource"), "/metrics");
        assert_eq!(requests[0].label("absent"), "");
        check(
            PAGE,
            "apiserver_longrunning_requests",
            &[(
                &[
                    ("component", "apiserver"),
                    ("group", "coordination.k8s.io"),
                    ("resource", "leases"),
                    ("scope", "namespace"),
                    ("subresource", ""),
                    ("verb", "WATCH"),
                    ("version", "v1"),
                ],
                2.0,
            )],
        );
        check(
            PAGE,
            "process_start_time_seconds",
            &[(&[], 1.71234567891e9)],
        );
        check(PAGE, "apiserver_registered_watchers", &[]);
    }

    #[test]
    fn values_and_escapes_follow_the_format() {
        check("m 1", "m", &[(&[], 1.0)]);
        check("m{} 2 1712345678000", "m", &[(&[], 2.0)]);
        check(r#"m{a="x"} +Inf"#, "m", &[(&[("a", "x")], f64::INFINITY)]);
        check(
            r#"m{a="q\"uote",b="back\\slash",c="new\nline",} 3"#,
            "m",
            &[(
                &[("a", "q\"uote"), ("b", "back\\slash"), ("c", "new\nline")],
                3.0,
            )],
        );
        check(r#"m{a="x, y}"} 4"#, "m", &[(&[("a", "x, y}")], 4.0)]);
        // A metric whose name starts like the wanted one is another metric.
        check("m_total 5\nm 6", "m", &[(&[], 6.0)]);
        let nan = samples("m NaN", |n| n == "m").unwrap();
        assert!(nan[0].value.is_nan());
    }

    #[test]
    fn malformed_wanted_lines_name_the_line_and_the_problem() {
        for (text, problem) in [
            ("\nm", "m has no value"),
            ("\nm{a=\"x\"}", "m has no value"),
            ("\nm abc", "not a number"),
            ("\nm{a=x} 1", "unquoted value"),
            ("\nm{a=\"x} 1", "not closed"),
            ("\nm{a=\"x\" b=\"y\"} 1", "expected ','"),
            ("\nm{=\"x\"} 1", "not a Prometheus label name"),
        ] {
            let err = samples(text, |n| n == "m").unwrap_err();
            assert_eq!(err.line, 2, "{text:?}");
            assert!(err.problem.contains(problem), "{text:?}: {err}");
            // Nobody asked for m: nothing is looked at.
            assert_eq!(samples(text, |n| n == "other").unwrap(), vec![]);
        }
    }

    const GOOD: &str = "# HELP flotilla_x_sessions Sessions open.
# TYPE flotilla_x_sessions gauge
flotilla_x_sessions{transport=\"grpc\"} 2
flotilla_x_sessions{transport=\"quic\"} 1
# HELP flotilla_x_refusals Sessions refused.
# TYPE flotilla_x_refusals counter
flotilla_x_refusals_total{reason=\"revoked\"} 3
# HELP flotilla_x_apply_duration_seconds Apply time.
# TYPE flotilla_x_apply_duration_seconds histogram
# UNIT flotilla_x_apply_duration_seconds seconds
flotilla_x_apply_duration_seconds_sum 0.5
flotilla_x_apply_duration_seconds_count 2
flotilla_x_apply_duration_seconds_bucket{le=\"0.1\"} 1
flotilla_x_apply_duration_seconds_bucket{le=\"1.0\"} 2
flotilla_x_apply_duration_seconds_bucket{le=\"+Inf\"} 2
# EOF
";

    #[test]
    fn a_strict_read_accepts_a_well_formed_page_and_finds_its_values() {
        let page = super::check(GOOD).expect("a good page");
        assert_eq!(page.families.len(), 3);
        assert_eq!(
            page.value("flotilla_x_sessions", &[("transport", "quic")]),
            Some(1.0)
        );
        assert_eq!(page.value("flotilla_x_refusals_total", &[]), Some(3.0));
        assert_eq!(
            page.family("flotilla_x_apply_duration_seconds")
                .map(|f| f.kind),
            Some(FamilyType::Histogram)
        );
    }

    /// Each case breaks the good page one way; the strict read must name the problem.
    #[test]
    fn a_strict_read_rejects_what_prometheus_would_not_take() {
        let cases: &[(&str, &str, &str)] = &[
            ("# HELP flotilla_x_sessions Sessions open.\n", "", "no HELP"),
            ("# TYPE flotilla_x_sessions gauge\n", "", "no family"),
            (
                "flotilla_x_refusals_total{",
                "flotilla_x_refusals{",
                "does not end in _total",
            ),
            (
                "flotilla_x_sessions{transport=\"quic\"}",
                "flotilla_x_sessions{transport=\"grpc\"}",
                "appears twice",
            ),
            ("{le=\"1.0\"} 2", "{le=\"1.0\"} 0", "not cumulative"),
            ("{le=\"+Inf\"} 2", "{le=\"+Inf\"} 3", "differs from _count"),
            ("transport=", "0transport=", "not a label name"),
            ("# EOF\n", "# EOF\nflotilla_x_sessions 1\n", "after # EOF"),
            (
                "\nflotilla_x_sessions{transport=\"grpc\"} 2",
                "\nflotilla-x-sessions 2",
                "not a metric name",
            ),
        ];
        for (from, to, problem) in cases {
            assert!(GOOD.contains(from), "case {from:?} does not apply");
            let bad = GOOD.replacen(from, to, 1);
            let err = super::check(&bad).expect_err(&format!("accepted with {from:?} -> {to:?}"));
            assert!(err.problem.contains(problem), "{from:?} -> {to:?}: {err}");
        }
    }
}
