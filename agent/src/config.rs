//! The agent's configuration, parsed and validated once at start.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

/// Upper bound of the random delay before the first connection after process start, so a site
/// that powers on all at once does not reach the hub in the same second.
pub const DEFAULT_INITIAL_JITTER: &str = "2s";
/// Largest backoff between reconnect attempts.
pub const DEFAULT_MAX_BACKOFF: &str = "60s";

#[derive(Clone, Debug, Args)]
pub struct AgentConfig {
    /// The hub's agent address, host:port (a gateway or the single-node hub).
    #[arg(long, env = "FLOTILLA_HUB")]
    pub hub: String,

    /// Name the hub's certificate is checked against (default: the host part of --hub).
    #[arg(long, env = "FLOTILLA_SERVER_NAME")]
    pub server_name: Option<String>,

    /// The managed cluster this agent speaks for; must match its certificate.
    #[arg(long, env = "FLOTILLA_CLUSTER_NAME")]
    pub cluster_name: String,

    /// Directory with ca.crt (the hub CA), tls.crt and tls.key (this cluster's identity).
    #[arg(long, env = "FLOTILLA_CERT_DIR")]
    pub cert_dir: PathBuf,

    /// Upper bound of the random delay before the first connection.
    #[arg(long, default_value = DEFAULT_INITIAL_JITTER, value_parser = humantime::parse_duration)]
    pub initial_jitter: Duration,

    /// Largest delay between reconnect attempts (exponential backoff with full jitter).
    #[arg(long, default_value = DEFAULT_MAX_BACKOFF, value_parser = humantime::parse_duration)]
    pub max_backoff: Duration,

    /// Kubernetes version reported to the hub (until the agent reads it from its apiserver).
    #[arg(long, env = "FLOTILLA_KUBERNETES_VERSION", default_value = "")]
    pub kubernetes_version: String,
}

impl AgentConfig {
    /// Host part of `--hub`, or `--server-name`.
    pub fn server_name(&self) -> String {
        self.server_name.clone().unwrap_or_else(|| {
            let host = self.hub.rsplit_once(':').map_or(self.hub.as_str(), |(h, _)| h);
            host.trim_start_matches('[').trim_end_matches(']').to_string()
        })
    }
}
