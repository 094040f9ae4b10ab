//! Just enough of the Prometheus text exposition format (version 0.0.4) to read a
//! kube-apiserver's `/metrics`: sample lines `name{label="value",...} value [timestamp]`,
//! with `#` lines and blank lines skipped.
//!
//! The apiserver's page is several megabytes of histograms; [`samples`] only builds the samples
//! whose metric name the caller asks for and skips every other line after reading its name.

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
}
