//! The log format every binary takes with `--log-format`.

use tracing_subscriber::EnvFilter;

/// How log lines are written to stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event (colours only on a terminal).
    #[default]
    Text,
    /// One JSON object per line, with the event's fields and its spans: for log collectors.
    Json,
}

/// Installs the process's subscriber: stderr, `RUST_LOG` filters (default `info`), in `format`.
/// The environment variable `FLOTILLA_LOG_FORMAT=json`, read by earlier releases, still turns
/// JSON on when the flag is left at its default.
pub fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let format = match format {
        LogFormat::Text if std::env::var("FLOTILLA_LOG_FORMAT").as_deref() == Ok("json") => {
            LogFormat::Json
        }
        f => f,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours for a terminal only: log files and collectors get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// An error and its causes as one line ("writing x failed: connection reset: broken pipe"), for
/// log fields and refusal texts, so whoever reads them sees why and not only what. A cause whose
/// text the line already holds (an error that prints its own source) is not repeated.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let more = e.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("{what}")]
    struct Failed {
        what: &'static str,
        #[source]
        cause: Option<Box<Failed>>,
    }

    fn failed(what: &'static str, cause: Option<Failed>) -> Failed {
        Failed {
            what,
            cause: cause.map(Box::new),
        }
    }

    #[test]
    fn the_chain_names_every_cause_once() {
        let io = failed("connection reset by peer", None);
        let kube = failed("error trying to connect", Some(io));
        // The outer error prints its source itself, as thiserror's `{source}` does.
        let store = failed(
            "store backend failed while listing ManifestWork: error trying to connect",
            Some(kube),
        );
        assert_eq!(
            error_chain(&store),
            "store backend failed while listing ManifestWork: error trying to connect: \
             connection reset by peer"
        );
        assert_eq!(error_chain(&failed("alone", None)), "alone");
    }
}
