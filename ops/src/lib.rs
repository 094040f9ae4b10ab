//! What every flotilla process serves to whoever runs it: Prometheus metrics on `/metrics`,
//! `/healthz` (the process is alive) and `/readyz` (it can do its job) on one plain-HTTP
//! listener of its own (`--metrics-addr`), its log format (`--log-format`), the request
//! budget of its Kubernetes clients (`rate`: `--kube-api-qps`, `--kube-api-burst`), and the one
//! way it owns and stops its long-lived tasks (`supervise`: named tasks, the first to end
//! reported with its cause, SIGTERM as the shutdown trigger). The hub, the gateway and the agent
//! share it, so the three speak the same way to Prometheus, kubelet probes, log collectors and
//! their supervisors.
//!
//! Kube components do the same: metrics and probes sit on their own port, so a probe needs no
//! client certificate and a scrape never touches the sessions' listener.
//!
//! Not for: deciding what a process measures or when it is ready (each crate owns its metrics
//! and its readiness conditions and hands them here), or anything agents and the hub say to
//! each other.
#![forbid(unsafe_code)]

pub mod deadline;
pub mod endpoint;
pub mod exposition;
pub mod logging;
pub mod rate;
pub mod readiness;
pub mod supervise;

pub use deadline::sleep_until;
pub use endpoint::{Endpoint, EndpointError, MetricsArgs, serve};
pub use logging::{LogFormat, error_chain, init_tracing};
pub use rate::{KubeApiArgs, KubeApiRate, TokenBucket};
pub use readiness::{Readiness, ReadyFlag};
pub use supervise::{TaskEnded, TaskError, TaskResult, Tasks, shutdown_signal};

/// A metric registry with every name under `flotilla_`.
pub fn registry() -> prometheus_client::registry::Registry {
    prometheus_client::registry::Registry::with_prefix("flotilla")
}
