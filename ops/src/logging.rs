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
